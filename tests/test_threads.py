"""Threads: --threads and ``load(threads=...)`` set torch's count for the process, the default is the cores the
process may use, and the command line makes OpenMP's threads spin only briefly while they wait unless the user
said otherwise. Within graft's own forward the operations run on every thread while the machine is free, and on
one, but for the products that pay, while other processes crowd it; which changes no bit."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

import graft_cli
from graft_cli.bench.synthetic import save_model_dir, tiny_model, word_tokenizer
from graft_cli.core import GraftError
from graft_cli.core.cpu_units import CpuUnits
from graft_cli.core import threads
from graft_cli.core.neighbours import Neighbours
from graft_cli.core.threads import (PARALLEL_BYTES, available_cores, crowded, fanned, product_pays, serial, spread,
                                    use_threads, wait_briefly, wide_only_if)
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.models import own_model
from graft_cli.models.invariant import causal_rows
from graft_cli.models.config import plain_config
from graft_cli.runtime import cpu_linear
from graft_cli.runtime.target import Target
from tests.bench_fixtures import run_cli, tiny_dir  # noqa: F401 - tiny_dir: the fixture
from tests.test_kv_cache import tokens
from tests.tiny import VOCAB, OracleTreeProposer


def test_the_default_is_the_cores_the_process_may_use(monkeypatch):
    assert available_cores() == len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert use_threads(None) == available_cores() == torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's setting wins
    assert use_threads(None) == 1 == torch.get_num_threads()
    assert use_threads(1) == 1 == torch.get_num_threads()
    with pytest.raises(GraftError, match="at least 1"):
        use_threads(0)


def test_load_and_generate_take_threads(tiny_dir, capsys):
    with graft_cli.load(str(tiny_dir), method="ar", device="cpu", threads=1) as g:
        assert torch.get_num_threads() == 1
        text = g.generate("one two three", max_new_tokens=6).text
    code, out, err = run_cli(["generate", "one two three", "--model", str(tiny_dir), "--method", "ar", "-n", "6",
                              "--device", "cpu", "--threads", "2"], capsys)
    assert code == 0 and torch.get_num_threads() == 2 and out.removesuffix("\n") == text  # same text, any count
    code, _, err = run_cli(["serve", "--threads", "0"], capsys)
    assert code == 2 and "--threads" in err


def test_threads_spin_briefly_while_waiting_unless_the_user_chose(monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    wait_briefly()
    assert os.environ["GOMP_SPINCOUNT"] == threads.WAIT_SPINS
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    wait_briefly()
    assert os.environ["GOMP_SPINCOUNT"] == "5"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # the user's policy: no spin count of graft's beside it
    wait_briefly()
    assert "GOMP_SPINCOUNT" not in os.environ
    assert crowded(0.0)  # threads that sleep at once: every small operation stays on one thread


def test_other_processes_crowd_the_cores_past_the_share_left_free():
    """Other processes' work = the cores' busy ticks less this process's own time, sampled every SAMPLE_EVERY."""
    counters = {"busy": 0, "own": 0.0}
    watch = Neighbours(frozenset({0, 1}), busy=lambda cpus: counters["busy"], own=lambda: counters["own"],
                       tick=0.01)
    assert watch.crowded(0.0, threads=2)  # nothing measured yet: as a forward ran before it spread

    def interval(now: float, others: float, own: float = 2.0, threads: int = 2) -> bool:
        counters["busy"] += round((others + own) * 100)  # a second's ticks of 10 ms
        counters["own"] += own
        return watch.crowded(now, threads)

    assert not interval(1.0, others=0.1)  # a quiet machine: graft's two threads are all the work
    assert not interval(1.2, others=1.0)  # within SAMPLE_EVERY of the last sample: the last answer
    assert interval(2.2, others=1.0)  # a busy neighbour on one of the two cores
    assert interval(3.2, others=0.2)  # between the marks: still crowded (no flapping)
    assert not interval(4.2, others=0.1)  # below FREE_BELOW: free again
    assert not interval(5.2, others=1.0, threads=1)  # one thread leaves a core free for the neighbour
    unreadable = Neighbours(frozenset({0}), busy=lambda cpus: None)
    assert unreadable.crowded(0.0, 2) and unreadable.crowded(9.0, 2)  # no /proc/stat: as before


def test_work_whose_bits_depend_on_the_count_runs_on_as_many_threads_either_way():
    torch.set_num_threads(2)  # the fixture restores the count
    seen = []
    for serially in (True, False):
        with serial(serially):
            for pays in (True, False):
                with wide_only_if(pays):
                    seen.append(torch.get_num_threads())
    assert seen == [2, 1, 2, 1]


def test_a_forward_is_serial_but_for_the_work_that_pays_for_threads():
    torch.set_num_threads(2)  # the fixture restores the count
    seen = []
    with serial():
        seen.append(torch.get_num_threads())
        with fanned(True):
            seen.append(torch.get_num_threads())
        with fanned(False):
            seen.append(torch.get_num_threads())
        with serial():  # nested: still one thread, and the products still fan out to the outer count
            with fanned(True):
                seen.append(torch.get_num_threads())
        seen.append(torch.get_num_threads())
    seen.append(torch.get_num_threads())
    with fanned(True), serial(False):  # outside a serial block, or not asked: nothing changes
        seen.append(torch.get_num_threads())
    assert seen == [1, 2, 1, 2, 1, 2, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_products_give_the_same_bits_on_one_thread_and_on_two(dtype):
    """What lets a step run on one thread and a tree's products on two: a row's bits do not change."""
    weight = torch.randn(576, 1536, generator=torch.Generator().manual_seed(0)).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, cpu_linear.PACK_BATCH)
    x = torch.randn(64, 1536, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results[threads] = [cpu_linear.packed_product(x[:rows], packed, None, 576) for rows in (1, 16, 64)]
    assert all(torch.equal(one, two) for one, two in zip(results[1], results[2]))


def test_a_large_weight_fans_out_even_for_one_row():
    """A one-token step's LM head streams faster on every thread, with the bits one thread gives."""
    assert product_pays(16, 0) and product_pays(1, PARALLEL_BYTES) and not product_pays(15, PARALLEL_BYTES - 1)
    weight = torch.randn(16384, 576, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # 18 MiB
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, cpu_linear.PACK_BATCH)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    torch.set_num_threads(1)
    alone = cpu_linear.packed_product(x, packed, None, 16384)
    torch.set_num_threads(2)
    with serial():
        assert torch.equal(cpu_linear.packed_product(x, packed, None, 16384), alone)


def test_pieces_of_work_spread_over_the_threads_a_serial_block_left():
    where = lambda: threading.current_thread().name  # noqa: E731
    torch.set_num_threads(2)
    assert spread([where, where]) == [threading.current_thread().name] * 2  # outside serial(): in turn, here
    with serial():
        names = spread([lambda i=i: (i, where()) for i in range(6)])
        assert [i for i, _ in names] == list(range(6))  # in order
        assert all(name.startswith("graft-spread") for _, name in names)
        assert spread([where]) == [threading.current_thread().name]  # one piece: no hand-over


def test_a_long_chunks_attention_pieces_give_the_same_bits_side_by_side():
    generator = torch.Generator().manual_seed(5)
    query, key, value = (torch.randn(1, heads, rows, 64, generator=generator).to(torch.bfloat16)
                         for heads, rows in ((6, 150), (2, 400), (2, 400)))
    alone = causal_rows(query, key, value, 0.125)
    torch.set_num_threads(2)
    with serial():
        assert torch.equal(causal_rows(query, key, value, 0.125), alone)


def test_bf16_trees_on_two_threads_decode_plain_one_thread_decodings_tokens(tmp_path, monkeypatch):
    """Steps on one thread, trees' and chunks' products on two: the tokens stay plain decoding's, exactly."""
    monkeypatch.setattr(cpu_linear, "cpu_units", lambda: CpuUnits("test", avx512_bf16=True))
    reference = tiny_model("llama", seed=4, layers=2, max_position_embeddings=1024, hidden_size=256,
                           intermediate_size=768, num_attention_heads=4, num_key_value_heads=2)
    folder = save_model_dir(tmp_path / "llama", reference, word_tokenizer())
    model = own_model(plain_config(folder), folder, torch.bfloat16)
    cpu_linear.use_cpu_linears(model, pack=True)
    prompt = np.random.default_rng(3).integers(0, VOCAB, 90).tolist()
    truth = tokens(Target(model, chunk=32), GraftProposer(0), prompt, 40)  # one thread: the fixture's
    torch.set_num_threads(2)
    for seed in range(2):
        assert tokens(Target(model, chunk=20 + seed), OracleTreeProposer(truth, len(prompt), seed, "mixed"), prompt,
                      40) == truth


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_forward_gives_the_same_bits_on_a_free_machine_and_a_crowded_one(dtype, tmp_path, monkeypatch):
    """Every operation on both threads (free) or on one but for the products that pay (crowded): one-row steps,
    a tree and a prompt's chunk, in fp32 (whose attention keeps its count) and in bf16."""
    from graft_cli.models import decoder
    from graft_cli.runtime.kv_cache import PositionCache

    monkeypatch.setattr(cpu_linear, "cpu_units", lambda: CpuUnits("test", avx512_bf16=True))
    reference = tiny_model("llama", seed=5, layers=2, max_position_embeddings=1024, hidden_size=256,
                           intermediate_size=768, num_attention_heads=4, num_key_value_heads=2)
    folder = save_model_dir(tmp_path / "llama", reference, word_tokenizer())
    model = own_model(plain_config(folder), folder, dtype)
    cpu_linear.use_cpu_linears(model, pack=True)
    ids = torch.tensor([np.random.default_rng(6).integers(0, VOCAB, 140).tolist()])
    tree = torch.ones(1, 1, 6, 136, dtype=torch.bool).tril(130)  # a chain of six after 130 cached keys
    torch.set_num_threads(2)
    logits = {}
    for crowd in (True, False):
        monkeypatch.setattr(decoder, "crowded", lambda now, crowd=crowd: crowd)
        cache, out = PositionCache(2), []
        with torch.inference_mode():
            out.append(model(input_ids=ids[:, :120], cache=cache).logits)  # a chunk
            for i in range(120, 130):  # one-row steps
                out.append(model(input_ids=ids[:, i : i + 1], cache=cache).logits)
            out.append(model(input_ids=ids[:, 130:136], attention_mask=tree, cache=cache, visible=130).logits)
        logits[crowd] = out
    assert all(torch.equal(a, b) for a, b in zip(logits[True], logits[False]))

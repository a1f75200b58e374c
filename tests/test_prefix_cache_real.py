"""The prefix cache on the real default model (SmolLM2-135M-Instruct, fp32 on the CPU): requests that share a system
prompt and a chat's second turn give, from a warm cache, the tokens a Generator without one gives, for
every method (its drafter's rows resumed too: a draft model, a random EAGLE-3 head), greedy and seeded."""

from __future__ import annotations

import pytest
import torch

from graft_cli.api import Generator
from graft_cli.method.config import configure
from graft_cli.runtime.loading import load_model

pytestmark = pytest.mark.real_model
MODEL = "smollm2-135m-instruct"
SYSTEM = ("You are the support agent of a small airline. Be brief and exact. Rebookings are free within 24 hours "
          "of purchase; after that a fee of 50 euros applies. Pets under 8 kg travel in the cabin. ") * 3


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(1)
    return load_model(MODEL, device="cpu", dtype="float32")


def requests(first_answer: str) -> list[dict]:
    turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Can I rebook my flight?"}]
    return [
        dict(messages=turn),
        dict(messages=[turn[0], {"role": "user", "content": "May my cat fly with me?"}]),
        dict(messages=[*turn, {"role": "assistant", "content": first_answer},
                       {"role": "user", "content": "And after two days?"}]),
    ]


def served(generator: Generator, sampling: dict) -> list[tuple[list[int], int]]:
    """The token ids and cached prompt tokens of each request in turn (the chat's second turn resends the first
    answer)."""
    first = generator.generate(**requests("")[0], **sampling)
    out = [(first.token_ids, first.stats.cached_tokens)]
    for request in requests(first.text)[1:]:
        completion = generator.generate(**request, **sampling)
        out.append((completion.token_ids, completion.stats.cached_tokens))
    return out


def configs(tmp_path, model) -> dict:
    from tests.test_eagle3 import write_head

    head = write_head(tmp_path / "head", model, seed=3)
    # each kind of state the cache keeps, once: the target's alone, a draft model's KV, an EAGLE-3 head's rows
    # (every method on each kind is tests/test_prefix_cache.py's, on tiny models, to keep the suite short)
    return {"ar": configure("ar"), "graft": configure("graft"),
            "graft-draft": configure("graft", draft=MODEL, depth=3),
            "graft-eagle3": configure("graft", draft=f"eagle3:{head}", depth=3)}


SAMPLED = {"graft-draft", "graft-eagle3"}


def test_every_method_from_a_warm_cache_gives_a_cold_generators_tokens(smollm2, tmp_path):
    for name, config in configs(tmp_path, smollm2.model).items():
        for sampling in [dict(max_new_tokens=8)] + ([dict(max_new_tokens=8, temperature=0.8, seed=5)]
                                                     if name in SAMPLED else []):
            warm = served(Generator(smollm2, config), sampling)
            cold = served(Generator(smollm2, config, prefix_cache=0), sampling)
            assert [ids for ids, _ in warm] == [ids for ids, _ in cold], (name, sampling)
            cached = [n for _, n in warm]
            assert cached[0] == 0 and all(n > 60 for n in cached[1:]), (name, cached)  # the policy at least
            assert all(n == 0 for _, n in cold)


def test_bf16_rows_are_the_same_bits_however_the_prompt_is_split():
    """In bf16 on a CPU a row's attention does not depend on the rows fed with it (graft_cli/models/invariant.py),
    so a hit's rows, a cold prompt's and those plain decoding wrote are one and the same: a hit is exact, not a
    near-tie. Checked on the cache's bits, then on what a warm Generator gives."""
    from graft_cli.core.cpu_units import cpu_units
    from graft_cli.runtime.kv_cache import PositionCache

    if not cpu_units().bf16:
        pytest.skip(f"no bf16 units here ({cpu_units().summary()}): bf16 runs emulated, unpacked")
    loaded = load_model(MODEL, "cpu", "bfloat16", forward="own")
    model, ids = loaded.model, loaded.tokenizer.encode(SYSTEM * 2)[:300]

    def rows(feeds: list[int]) -> torch.Tensor:
        cache, start = PositionCache(model.config.num_hidden_layers), 0
        cache.reserve(len(ids))
        with torch.inference_mode():
            for end in feeds:
                model(input_ids=torch.tensor([ids[start:end]]), cache=cache, logits_to_keep=1, visible=start)
                start = end
        return cache.block[..., : len(ids), :]

    whole = rows([len(ids)])
    assert torch.equal(rows([77, 200, len(ids)]), whole)
    assert torch.equal(rows([250, *range(251, len(ids) + 1)]), whole)  # the last 50 one token at a time
    for method in ("ar", "graft"):
        warm = served(Generator(loaded, configure(method)), dict(max_new_tokens=24))
        cold = served(Generator(loaded, configure(method), prefix_cache=0), dict(max_new_tokens=24))
        assert [ids for ids, _ in warm] == [ids for ids, _ in cold], method
        assert all(n > 60 for _, n in warm[1:])

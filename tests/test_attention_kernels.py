"""graft's forwards run with cuDNN's attention switched off on a GPU (graft_cli/runtime/attention_kernels.py), and only
while they run. On this CPU the switch is tested by counting the CPU as a GPU: the flag is torch's, device-free."""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch

from graft_cli.runtime import attention_kernels as kernels
from graft_cli.runtime.attention_kernels import GroupedQueryAttention, NoCudnnAttention, attention_kernels
from plugins.draft_model import DraftCache
from graft_cli.heads import load_head
from graft_cli.runtime.target import Target
from graft_cli.core import ROOT, Tree
from tests.test_eagle3 import target_model, write_head
from tests.tiny import tiny_model


def cudnn() -> bool:
    return torch.backends.cuda.cudnn_sdp_enabled()


def test_the_switch_restores_what_was_there_and_nests():
    assert cudnn()
    guard = NoCudnnAttention()
    with guard:
        assert not cudnn()
        with guard:
            assert not cudnn()
        assert not cudnn()
    assert cudnn()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        with guard:
            assert not cudnn()
        assert not cudnn()  # a user's own choice survives
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def test_a_gpu_switches_cudnn_off_and_a_cpu_asks_for_grouped_attention(monkeypatch):
    assert isinstance(attention_kernels(torch.device("cuda")), NoCudnnAttention)
    assert isinstance(attention_kernels(torch.device("meta")), nullcontext)
    monkeypatch.delenv(GroupedQueryAttention.SWITCH, raising=False)
    grouped = attention_kernels(torch.device("cpu"))
    with grouped:
        assert os.environ[GroupedQueryAttention.SWITCH] == "1"
        with grouped:  # nested: the outer setting survives the inner exit
            pass
        assert os.environ[GroupedQueryAttention.SWITCH] == "1"
    assert GroupedQueryAttention.SWITCH not in os.environ  # the process as it was


def test_every_forward_of_graft_runs_without_cudnn_attention(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "PLANNED", frozenset({"cuda", "cpu"}))
    seen: list[bool] = []  # the flag at each attention call
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(cudnn())
        return real(*args, **kwargs)

    def calls(forward) -> list[bool]:
        seen.clear()
        forward()
        return list(seen)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    target = Target(tiny_model())
    target.model.set_attn_implementation("sdpa")  # transformers' SDPA (the CPU's split attention calls aten)
    tree = Tree()
    tree.add(tree.add(ROOT, 5, "test", 0.5), 6, "test", 0.5)
    draft = DraftCache(tiny_model(seed=1))
    draft.model.set_attn_implementation("sdpa")
    big = target_model()
    head = load_head(str(write_head(tmp_path / "h", big)), big)
    features = head.fuse(torch.randn(2, 3 * big.config.hidden_size))
    for forward in (lambda: target.prefill([1, 2, 3, 4]), lambda: target.verify(7, tree),
                    lambda: draft.feed(torch.tensor([1, 2]), torch.arange(2), None, 0),
                    lambda: head.forward(torch.tensor([1, 2]), features, torch.arange(2),
                                         torch.ones(2, 2, dtype=torch.bool).tril())):
        flags = calls(forward)
        assert flags and not any(flags)
    assert cudnn()  # and only while they ran

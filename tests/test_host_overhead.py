"""benchmarks/host_overhead.py on a machine that has never profiled the target: the cost-aware builder's latency
profile is measured before the record, so the replays still match it."""

from graft_cli.core import DraftSettings
from graft_cli.catalog.home import graft_home
from graft_cli.runtime.loading import load_model
from graft_cli.method.builder import MethodConfig
from benchmarks import host_overhead
from benchmarks.gpu_check import synthetic_dirs
from benchmarks.gpu_setup import SMOKE


def test_a_fresh_home_profiles_before_the_record(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    target_dir, _ = synthetic_dirs(tmp_path, SMOKE)
    loaded = load_model(str(target_dir), "cpu", "float32")
    assert not (graft_home() / "profiles").exists()
    config = MethodConfig("graft", budget=60, retrievers=["prompt", "recycling"], draft=str(target_dir), drafting=DraftSettings(depth=7, draft_top_k=8))  # a cost-built tree: the builder reads the profile
    m = host_overhead.measure(loaded, [[5, 6, 7, 8, 5, 6, 7]], config, max_new_tokens=12, repeat=1)
    assert m.steps > 0 and any((graft_home() / "profiles").iterdir())


def test_a_replay_advances_the_caches_rows_without_moving_keys(tmp_path, monkeypatch):
    """A GPU writes keys and values in its own memory, so the replay only advances each layer's filled rows
    (the zeros of ``write_kv`` would evict the host code's caches); both ways decode the record's tokens, which
    ``measure`` checks, in as many steps."""
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    target_dir, _ = synthetic_dirs(tmp_path, SMOKE)
    loaded = load_model(str(target_dir), "cpu", "float32")
    config = MethodConfig("graft", budget=60, retrievers=["prompt", "recycling"], draft=str(target_dir), drafting=DraftSettings(depth=7, draft_top_k=8))
    runs = [host_overhead.measure(loaded, [[5, 6, 7, 8, 5, 6, 7]], config, max_new_tokens=12, repeat=1,
                                  write_kv=write) for write in (False, True)]
    assert runs[0].steps == runs[1].steps > 0 and runs[0].tokens == runs[1].tokens


def test_the_fixed_shape_path_replays_with_one_read_from_the_target(tmp_path, monkeypatch):
    """``--fixed-shapes``: the same decoding (measure checks the tokens), the target's share of a step one read."""
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    target_dir, _ = synthetic_dirs(tmp_path, SMOKE)
    loaded = load_model(str(target_dir), "cpu", "float32")
    config = MethodConfig("graft", budget=60, retrievers=["prompt"])
    runs = [host_overhead.measure(loaded, [[5, 6, 7, 8, 5, 6, 7]], config, max_new_tokens=16, repeat=1, fixed=fixed)
            for fixed in (False, True)]
    assert runs[0].tokens == runs[1].tokens and runs[0].steps == runs[1].steps > 0
    assert runs[1].reads["accept"] == runs[1].steps and runs[1].reads["mask"] == runs[1].reads["keep"] == 0

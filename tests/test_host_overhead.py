"""The host-time instrument (benchmarks/host_time/): it measures through the recorder it hands graft's builder, its
replays decode what the record did, and it leaves the models it wrapped as it found them."""

from graft_cli.bench.synthetic import synthetic_models
from graft_cli.catalog.home import graft_home
from graft_cli.method.config import configure
from graft_cli.runtime.loading import load_model
from benchmarks import host_time
from benchmarks.gpu_setup import SMOKE

PROMPT = [5, 6, 7, 8, 5, 6, 7]


def synthetic_dirs(root):
    """The smoke-sized target and a random EAGLE-3 head for it."""
    return synthetic_models(root, SMOKE.vocab, SMOKE.hidden, SMOKE.layers)


def test_a_fresh_home_needs_no_profile_and_the_models_are_put_back(tmp_path, monkeypatch):
    """Trees are chosen by the CUDA curve, so a machine that never profiled the target measures no profile (its
    forwards would land in the record); the target model's forward is its class's again afterwards."""
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    target_dir, _ = synthetic_dirs(tmp_path)
    loaded = load_model(str(target_dir), "cpu", "float32")
    config = configure("graft", budget=60, retrievers=["prompt", "recycling"], draft=str(target_dir), depth=7,
                       draft_top_k=8)  # a cost-built tree
    m = host_time.measure(loaded, [PROMPT], config, max_new_tokens=12, repeat=1)
    assert m.steps > 0 and not (graft_home() / "profiles").exists()
    assert "forward" not in vars(loaded.model) and m.time["propose"] > 0 and m.modelled["verify"] > 0


def test_a_replay_advances_the_caches_rows_without_moving_keys(tmp_path, monkeypatch):
    """A GPU writes keys and values in its own memory, so the replay only advances each layer's filled rows
    (the zeros of ``write_kv`` would evict the host code's caches); both ways decode the record's tokens, which
    ``measure`` checks, in as many steps."""
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    target_dir, _ = synthetic_dirs(tmp_path)
    loaded = load_model(str(target_dir), "cpu", "float32")
    config = configure("graft", budget=60, retrievers=["prompt", "recycling"], draft=str(target_dir), depth=7,
                       draft_top_k=8)
    runs = [host_time.measure(loaded, [PROMPT], config, max_new_tokens=12, repeat=1, write_kv=write)
            for write in (False, True)]
    assert runs[0].steps == runs[1].steps > 0 and runs[0].tokens == runs[1].tokens


def test_the_fixed_shape_path_replays_with_one_read_from_the_target(tmp_path, monkeypatch):
    """``--fixed-shapes``: the same decoding (measure checks the tokens), the target's share of a step one read,
    in the loop's own verify phase."""
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    target_dir, _ = synthetic_dirs(tmp_path)
    loaded = load_model(str(target_dir), "cpu", "float32")
    config = configure("graft", budget=60, retrievers=["prompt"])
    runs = [host_time.measure(loaded, [PROMPT], config, max_new_tokens=16, repeat=1, fixed=fixed)
            for fixed in (False, True)]
    assert runs[0].tokens == runs[1].tokens and runs[0].steps == runs[1].steps > 0
    assert runs[1].reads["verify"] == runs[1].steps and runs[1].reads["inputs"] == runs[1].reads["keep"] == 0


def test_a_head_drafts_ahead_inside_the_step_and_only_that_overlaps(tmp_path, monkeypatch):
    """An EAGLE-3 head at fixed shapes: its next draft is queued inside the step before the read (the ``queue``
    phase, what a GPU overlaps with its verification), its levels are captured regions, and a step still reads
    the device once."""
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    target_dir, head_dir = synthetic_dirs(tmp_path)
    loaded = load_model(str(target_dir), "cpu", "float32")
    config = configure("graft", budget=60, retrievers=["prompt"], draft=f"eagle3:{head_dir}", depth=7, draft_top_k=8)
    m = host_time.measure(loaded, [PROMPT], config, max_new_tokens=16, repeat=1, draft_share=0.1, fixed=True)
    assert m.time["queue"] > 0 and m.calls["captured"] > 0 and m.exposed_ms < m.host_ms
    assert m.syncs == 1.0 and m.modelled["draft"] > 0

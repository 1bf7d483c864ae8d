"""``baton profile`` and ``planner.profile``: a real engine's step times measured on a tiny
model, written as a file, read back, and seeding the planner so that it decides from its
first tick; bad files refused naming the problem (cluster/profile_run.py,
cluster/planner/profile.py)."""

from __future__ import annotations

import json
import logging

import pytest

from cluster.cli import main
from cluster.config import ConfigError, load_config
from cluster.planner.policy import Observation, Planner, PlannerConfig
from cluster.planner.profile import load_profile
from cluster.planner.simulator import SimRequest
from cluster.planner.step_model import StepModel
from cluster.planner_ray import seed_from_profile
from cluster.profile_run import Grid, decode_points, prefill_lengths
from cluster.tools.make_model import make_model
from workers.engine.config import EngineConfig
from workers.serving.worker_spec import WorkerSpec


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A tiny model's config and the profile `baton profile --quick` wrote for it."""
    root = tmp_path_factory.mktemp("profile")
    make_model(root / "tiny", "llama", "tiny")
    config = root / "cluster.yaml"
    config.write_text(f"model:\n  path: {root / 'tiny'}\ndecode:\n  max_num_seqs: 16\n")
    out = root / "profile.json"
    assert main(["profile", str(config), "--quick", "--out", str(out)]) == 0
    return config, out


def test_the_profile_holds_measured_records_of_every_grid_point(profiled):
    _, out = profiled
    profile = load_profile(out)
    assert profile.model == "tiny" and profile.device == "cpu" and profile.threads >= 1
    assert profile.engine["max_num_seqs"] == 16 and profile.engine["max_model_len"] > 256
    # --quick: prompts 16..256, two repeats each; batches 1..8 at contexts 64 and 512 whose
    # prompts take at most 2048 tokens to prefill (so no 8 x 512)
    assert [r.tokens for r in profile.prefill] == [n for n in (16, 32, 64, 128, 256) for _ in "ab"]
    assert all(r.attention_work == r.tokens**2 / 1000 for r in profile.prefill)
    points = {(r.batch, r.kv_tokens // r.batch // 64 * 64) for r in profile.decode}
    assert points == {(1, 64), (1, 512), (2, 64), (2, 512), (4, 64), (4, 512), (8, 64)}
    assert len(profile.decode) == 7 * 2 * 2  # points x repeats x steps
    for r in profile.decode:  # each step's KV: its batch's contexts plus what they decoded
        assert r.batch * 64 < r.kv_tokens < r.batch * (512 + 32)
    assert all(0 < r.seconds < 5 for r in [*profile.prefill, *profile.decode])
    assert 0 < profile.seconds < 300


def test_a_seeded_planner_decides_at_its_first_tick(profiled):
    _, out = profiled
    profile = load_profile(out)
    config = PlannerConfig(ttft_p90_ms=1000, itl_p90_ms=100, max_workers=4)
    window = tuple(SimRequest(i * 0.1, 128, 16) for i in range(50))
    observation = Observation(10.0, 1, 1, 10.0, window)

    cold = Planner(config, StepModel(warmup_steps=20))
    assert cold.tick(observation).reason.startswith("hold: step-time fits still warming up")

    model = StepModel(warmup_steps=20)
    assert model.seed(profile.steps()) == len(profile.prefill) + len(profile.decode)
    assert model.is_ready
    decision = Planner(config, model).tick(observation)
    assert "warming up" not in decision.reason
    assert decision.predicted_ttft_p90_ms > 0 and decision.predicted_itl_p90_ms > 0
    # The fits' predictions are the measured records' order of magnitude.
    longest = max(profile.prefill, key=lambda r: r.tokens)
    predicted = model.prefill_seconds(longest.tokens, longest.attention_work)
    assert longest.seconds / 10 < predicted < longest.seconds * 10


def test_planner_profile_in_the_config_is_read_at_load(profiled, tmp_path):
    config, out = profiled
    good = tmp_path / "good.yaml"
    good.write_text(config.read_text() + f"planner:\n  enabled: true\n  profile: {out}\n")
    assert load_config(str(good)).planner.profile == str(out)

    missing = tmp_path / "missing.yaml"
    missing.write_text(f"planner:\n  profile: {tmp_path / 'nope.json'}\n")
    with pytest.raises(ConfigError, match=r"planner\.profile.*nope\.json: cannot read"):
        load_config(str(missing))


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda d: d.update(version=99), "version 99"),
        (lambda d: d.update(decode=d["decode"][:3]), "decode: 3 records"),
        (lambda d: d["prefill"][0].update(seconds=0), "seconds <= 0"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d["prefill"][0].update(tokens="many"), "tokens"),
    ],
)
def test_a_file_that_is_not_a_profile_is_refused_naming_why(profiled, tmp_path, edit, why):
    document = json.loads(profiled[1].read_text())
    edit(document)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(document))
    with pytest.raises(ValueError, match=f"bad.json: not a step profile: .*{why}"):
        load_profile(bad)


def test_a_profile_of_other_settings_seeds_with_a_warning(profiled, caplog):
    profile = load_profile(profiled[1])
    engine = EngineConfig(model="/m", max_num_seqs=32)
    spec = WorkerSpec(name="decode-0", role="decode", model_id="other", engine=engine)
    model = StepModel()
    with caplog.at_level(logging.WARNING, logger="cluster.planner_ray"):
        added = seed_from_profile(model, profile, {"decode": (spec, {})})
    assert added == len(profile.prefill) + len(profile.decode) and model.is_ready
    assert "model ('tiny', serving 'other'), max_num_seqs" in caplog.text


def test_profile_refuses_a_multi_rank_pool(profiled, tmp_path, capsys):
    config = tmp_path / "tp.yaml"
    config.write_text(profiled[0].read_text() + "prefill:\n  tensor_parallel: 2\n")
    assert main(["profile", str(config), "--quick", "--out", str(tmp_path / "p.json")]) == 2
    assert "prefill: tensor_parallel 2" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_the_grid_fits_the_engine():
    grid = Grid(repeats=3, decode_steps=4)
    assert prefill_lengths(300, grid) == [16, 32, 64, 128, 256]
    points = decode_points(2046, 16 * 1024, 64, 2048, grid)
    assert (1, 2048) not in points  # 2048 + its decode steps pass max_model_len
    assert (1, 512) in points and (16, 512) in points
    # 32 x 512 tokens and what they decode fill more than the 16k-token cache
    assert (32, 512) not in points and (64, 64) in points
    assert max(b * c for b, c in points) <= grid.max_setup_tokens

"""`ember serve --ray` and its flags (each with its EMBER_* variable), the engine
deployment's options they make, and the default path that never imports Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ember.cli import build_parser, main, settings_from
from ember.config import RaySettings, ServerSettings
from tests.live_server import REPO, server_env


def test_ray_flags_and_their_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_MAX_REPLICAS", "4")
    monkeypatch.setenv("EMBER_RAY_ADDRESS", "10.0.0.1:6379")
    args = build_parser().parse_args(["serve", "--ray", "--min-replicas", "2",
                                      "--target-ongoing-requests", "8",
                                      "--max-ongoing-requests", "12"])
    ray = settings_from(args).ray
    assert ray == RaySettings(address="10.0.0.1:6379", min_replicas=2, max_replicas=4,
                              target_ongoing_requests=8.0, max_ongoing_requests=12)
    assert ray.autoscaling
    # Without --ray its settings would be ignored: refused, flags and variables alike.
    with pytest.raises(ValueError, match="--ray-address, --max-replicas take effect with "
                       "--ray only"):
        settings_from(build_parser().parse_args(["serve"]))
    monkeypatch.delenv("EMBER_MAX_REPLICAS")
    monkeypatch.delenv("EMBER_RAY_ADDRESS")
    assert settings_from(build_parser().parse_args(["serve"])).ray is None  # no --ray


def test_engine_options_follow_the_settings() -> None:
    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    from ember.cluster.app import autoscaling_config, engine_options

    fixed = engine_options(ServerSettings(ray=RaySettings(replicas=3)))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1}
    gpu = engine_options(ServerSettings(device="cuda:0", ray=RaySettings(max_replicas=4)))
    assert gpu["ray_actor_options"]["num_gpus"] == 1 and "num_replicas" not in gpu
    assert gpu["autoscaling_config"]["min_replicas"] == 1
    assert gpu["autoscaling_config"]["max_replicas"] == 4
    assert gpu["autoscaling_config"]["target_ongoing_requests"] == 128  # 2 x 64 items
    # A replica is full when Ember's queue is; Ray's router then holds one batch, not more.
    assert fixed["max_ongoing_requests"] == 4096 and fixed["max_queued_requests"] == 64
    set_by_hand = RaySettings(max_ongoing_requests=100, max_queued_requests=7)
    mine = engine_options(ServerSettings(ray=set_by_hand))
    assert mine["max_ongoing_requests"] == 100 and mine["max_queued_requests"] == 7
    quick = autoscaling_config(RaySettings(min_replicas=1, max_replicas=2,
                                           upscale_delay_s=1, downscale_delay_s=3), 8)
    assert quick["look_back_period_s"] == 1 and quick["metrics_interval_s"] == 0.5
    assert quick["target_ongoing_requests"] == 16



def test_a_drain_on_ray_outlasts_the_longest_request_the_settings_allow() -> None:
    """Ray kills a stopping replica after its graceful timeout, with whatever it still
    holds: 120 s, or past --request-timeout-s where that is longer."""
    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    from ember.cluster.app import engine_options, ingress_options

    for options in (engine_options, ingress_options):
        assert options(ServerSettings())["graceful_shutdown_timeout_s"] == 120
        assert options(ServerSettings(request_timeout_s=30))["graceful_shutdown_timeout_s"] == 120
        assert options(ServerSettings(request_timeout_s=600))["graceful_shutdown_timeout_s"] == 610


@pytest.mark.parametrize("flags, message", [
    (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is over"),
    (["--replicas", "0"], "must be 1 or more"),
    (["--max-ongoing-requests", "0"], "must be positive"),
    (["--max-queued-requests", "-1"], "must be positive"),
    # Found by a review of the Ray path: the flag was ignored, or every model load failed.
    (["--replicas", "3", "--max-replicas", "4"], "give one or the other"),
    (["--device", "cuda:1"], "sees the GPU it was given as cuda:0; use --device cuda"),
])
def test_bad_ray_flags_are_refused_before_ray_starts(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--ray", "--default-model", "ember/synthetic", *flags])
    assert code == 2
    assert message in capsys.readouterr().err


def test_the_default_path_never_imports_ray() -> None:
    """What `./run serve` loads without --ray: the CLI, one process and the supervisor."""
    probe = ("import sys, ember.cli, ember.server, ember.supervisor, ember.api.app, "
             "ember.ipc.engine; sys.exit(1 if 'ray' in sys.modules else 0)")
    result = subprocess.run([sys.executable, "-c", probe], env=server_env(), cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_cpu_replicas_of_a_local_instance_share_its_cores() -> None:
    """Each CPU engine replica defaulted to every core for its threads: four replicas on a
    16-core machine ran 64 busy threads."""
    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    from ember.cluster.run import with_cores_shared

    def threads(settings: ServerSettings) -> tuple[int | None, int | None]:
        shared = with_cores_shared(settings, cores=16)
        return shared.torch_threads, shared.onnx_threads

    assert threads(ServerSettings(ray=RaySettings(replicas=4))) == (4, 4)
    assert threads(ServerSettings(ray=RaySettings(min_replicas=1, max_replicas=3))) == (5, 5)
    assert threads(ServerSettings(ray=RaySettings(replicas=32))) == (1, 1)
    # Left alone: a flag's count, one replica, a GPU, and a cluster Ray places replicas on.
    assert threads(ServerSettings(ray=RaySettings(replicas=4), torch_threads=2)) == (2, 4)
    assert threads(ServerSettings(ray=RaySettings(replicas=1))) == (None, None)
    assert threads(ServerSettings(ray=RaySettings(replicas=4), device="cuda")) == (None, None)
    assert threads(ServerSettings(ray=RaySettings(replicas=4, address="10.0.0.1:6379"))) == (
        None, None)

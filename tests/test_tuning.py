"""The launch layer's public surface without a GPU: config text, backend options, the tuner's lookup order (stored
winners on disk, the shipped table, timing only when asked, the heuristic pick otherwise), and ``import attnzoo``
without Triton.  GPU identities and timings are faked; nothing here launches a kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnzoo
from attnzoo.kernels import tuning
from attnzoo.kernels.tuning import Autotuner, DeviceIdentity, KernelConfig

ROOT = Path(__file__).resolve().parents[1]
H100 = DeviceIdentity("NVIDIA H100 80GB HBM3", (9, 0), "3.6.0", "0.1.0")
OTHER_GPU = DeviceIdentity("NVIDIA A100-SXM4-80GB", (8, 0), "3.6.0", "0.1.0")
# A key of the H100 grid (fp16, D = 128, N = 8192, non-causal) and one outside it (N = 64).
GRID_KEY = ("forward", 128, torch.float16, False, False, 8192, 8192, "ieee", 0)
OFF_GRID_KEY = ("forward", 128, torch.float16, False, False, 64, 64, "ieee", 0)


@pytest.fixture
def tuner(monkeypatch, tmp_path):
    """A fresh tuner (as in a new process) with its disk cache in ``tmp_path``, on a faked H100, tuning not asked."""
    monkeypatch.setenv("ATTNZOO_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNZOO_AUTOTUNE", raising=False)
    monkeypatch.setattr(tuning, "AUTOTUNER", Autotuner())
    monkeypatch.setattr(tuning, "_device_identity", lambda index: H100)
    monkeypatch.setattr(tuning, "_launched", lambda cfg, launch, reset: (reset and reset(), launch(cfg)) and True)
    return tuning.AUTOTUNER


def _no_timing(key, configs, launch, reset):
    raise AssertionError("timed although no tuning was asked for")


def _fake_timing(winner: KernelConfig, events: list):
    """A stand-in for Autotuner.choose that launches every candidate after its reset and picks ``winner``."""

    def choose(key, configs, launch, reset):
        for cfg in configs:
            reset()
            launch(cfg)
            events.append(("trial", cfg))
        tuning.AUTOTUNER.best[key] = winner
        return winner

    return choose


def test_config_text_round_trips():
    for configs in tuning.CANDIDATES.values():
        for cfg in configs:
            assert KernelConfig.parse(str(cfg)) == cfg
    assert KernelConfig.parse("128x64 w8 s3 tma gluon") == KernelConfig(128, 64, 8, 3, tma=True, gluon=True)
    persistent = KernelConfig(128, 128, 8, 2, gluon=True, persistent=True)
    assert KernelConfig.parse("128x128 w8 s2 gluon persistent") == persistent and str(persistent).endswith("persistent")
    bad_texts = ("128x64", "128x64 w8 s3 fast", "100x64 w8 s3", "128x64 w8 s0", "128x64 w8 s3 tma tma", "")
    # persistent: a flag of the warp-specialised (128-row) Gluon forward tiles only
    bad_texts += ("128x128 w8 s2 persistent", "64x64 w4 s2 gluon persistent")
    for bad in bad_texts:
        with pytest.raises(ValueError, match="kernel config"):
            KernelConfig.parse(bad)


def test_backend_options():
    assert attnzoo.get("triton_atomic", delta="recompute") is attnzoo.get("triton_atomic", delta="recompute")
    assert attnzoo.get("triton_atomic", delta="recompute") is not attnzoo.get("triton_atomic")
    assert repr(attnzoo.get("triton_atomic", delta="recompute")) == "<attnzoo backend triton_atomic delta=recompute>"
    assert repr(attnzoo.get("torch_fa2")) == "<attnzoo backend torch_fa2>"
    pinned = attnzoo.get("triton_2kernel", configs={"forward": "128x64 w8 s3 tma", "dkdv": "64x64 w4 s2 gluon"})
    assert pinned.configs == {
        "forward": KernelConfig(128, 64, 8, 3, tma=True),
        "dkdv": KernelConfig(64, 64, 4, 2, gluon=True),
    }
    assert "forward: 128x64 w8 s3 tma" in repr(pinned)
    assert attnzoo.get("numpy_ref", block_m=32).block_m == 32
    with pytest.raises(TypeError, match="'block'"):
        attnzoo.get("torch_fa2", block=32)
    with pytest.raises(TypeError, match="'delta'"):
        attnzoo.get("triton_2kernel", delta="recompute")
    with pytest.raises(ValueError, match="'atomic'"):
        attnzoo.get("triton_2kernel", configs={"atomic": "64x64 w4 s2"})
    with pytest.raises(ValueError, match="kernel config"):
        attnzoo.get("triton_2kernel", configs={"forward": "64 by 64"})


def test_problem_carries_seqlens_k():
    q = torch.randn(2, 1, 4, 8)
    sl = torch.tensor([4, 1])
    problem = attnzoo.validation.validate_forward(q, q, q, True, None, sl)
    assert problem.seqlens_k is sl and problem.has_seqlens_k
    assert not attnzoo.validation.validate_forward(q, q, q).has_seqlens_k


@pytest.mark.parametrize(
    "causal, window, key",
    [
        (True, (256, 0), "window<=256"),
        (True, (1024, 0), "window<=1024"),
        (True, (4096, 0), "window<=4096"),
        (True, (300, -20), "window<=512"),  # the band from 300 keys left of the diagonal to 20 keys left of it
        (False, (100, 100), "window<=256"),
        (True, (8190, 0), "window<=8192"),
        (True, (8191, 0), ""),  # every key before the row: the causal call's own key
        (True, (10**9, 0), ""),
        (False, (None, 50), "window<=16384"),  # every key before the row and 50 after it
        (False, (64, None), "window<=16384"),
        (True, None, ""),
    ],
)
def test_the_tuning_key_holds_the_window_span_bucket(causal, window, key):
    """Windows of different spans keep their own tuned winners (a 256-key band leaves a 128-row block three key
    tiles, a 4096-key one thirty-three); a side reaches at most as far as the score matrix does (N = 8192 here), and
    a window that hides no key is the call without it: no window flag, the plain key."""
    from attnzoo.kernels.launch import ScoreModifiers

    q = torch.randn(1, 2, 8192, 64)
    problem = attnzoo.validation.validate_forward(q, q, q, causal, None, None, window)
    modifiers = ScoreModifiers.of(problem, q.device, 64, 64)
    assert modifiers.key == key
    assert (modifiers.flags["WINDOW_LEFT"] or modifiers.flags["WINDOW_RIGHT"]) == bool(key)


@pytest.mark.parametrize("kernel", ["forward", "dq", "dkdv"])
def test_the_untimed_pick_under_a_window_follows_its_span(tuner, monkeypatch, kernel):
    """Head-dim tile 128, no stored winner: under a window of at most 256 keys the forward and dQ kernels take the
    64x64 Gluon tile (the tuned winner at every w = 256 key of the H100's tuning); up to 1024 keys the forward takes
    the persistent tile (the winner at every w = 1024 key); wider windows, and the other kernels, the usual pick."""
    monkeypatch.setattr(tuning, "shared_memory_limit", lambda device: 232_448)  # an H100's
    configs = tuning.candidates(kernel, 128, torch.bfloat16, torch.device("cpu"))
    usual = str(tuning.heuristic_pick(kernel, 128, configs))
    picks = {"narrow": "64x64 w4 s2 gluon" if kernel != "dkdv" else usual, "usual": usual}
    picks["medium"] = "128x128 w8 s2 gluon persistent" if kernel == "forward" else usual
    spans = (("window<=128", "narrow"), ("window<=256 softcap", "narrow"), ("window<=512", "medium"),
             ("window<=1024", "medium"), ("window<=2048", "usual"))  # fmt: skip
    assert usual != picks["medium"] or kernel != "forward"
    for modifiers, span in spans:
        key = (kernel, 128, torch.bfloat16, True, False, 2048, 2048, "ieee", modifiers, "", "", 0)
        expected = picks[span]
        assert str(tuning.launch_with_best(key, lambda: configs, lambda c: None)) == expected, modifiers
        assert tuner.sources[key] == "heuristic"


def test_disk_cache_round_trip_and_merge(tuner, tmp_path):
    cfg = KernelConfig(64, 64, 4, 3)
    tuner.store.save(H100, tuning.key_text(OFF_GRID_KEY), cfg)
    # Another process wrote another key meanwhile: both survive the next write.
    other = Autotuner().store
    other.save(H100, "dq BLOCK_D=64 float16 causal=True seqlens=False Nq<=64 Nk<=64 dot=ieee", cfg)
    tuner.store.save(H100, tuning.key_text(GRID_KEY), cfg)
    files = list(tmp_path.glob("tuning_*.json"))
    assert len(files) == 1 and "sm90" in files[0].name and "triton-3.6.0" in files[0].name
    data = json.loads(files[0].read_text())
    assert data["gpu"] == H100.name and data["capability"] == [9, 0] and len(data["winners"]) == 3
    fresh = Autotuner().store  # a later process reads them
    assert fresh.winners(H100)[tuning.key_text(OFF_GRID_KEY)] == str(cfg)
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]


def test_a_corrupt_cache_file_is_ignored_with_one_warning(tuner, tmp_path):
    tuning.cache_file(H100).write_text("{not json")
    tuner.choose = _no_timing
    configs = tuning.CANDIDATES["forward"]
    with pytest.warns(UserWarning, match="unreadable tuning cache"):
        cfg = tuning.launch_with_best(OFF_GRID_KEY, lambda: configs, lambda c: None)
    assert cfg == tuning.heuristic_pick("forward", 128, configs)
    tuner.store.save(H100, tuning.key_text(OFF_GRID_KEY), cfg)  # replaced by a readable file
    assert json.loads(tuning.cache_file(H100).read_text())["winners"]


def test_the_shipped_table_is_used_on_its_gpu_only(tuner, monkeypatch):
    tuner.choose = _no_timing
    configs = tuning.CANDIDATES["forward"]
    shipped = tuning.shipped_winners(H100)[tuning.key_text(GRID_KEY)]
    assert tuning.launch_with_best(GRID_KEY, lambda: configs, lambda c: None) == KernelConfig.parse(shipped)
    assert tuning.chosen_configs()[tuning.key_text(GRID_KEY)] == (shipped, "shipped")
    monkeypatch.setattr(tuning, "AUTOTUNER", Autotuner())
    monkeypatch.setattr(tuning, "_device_identity", lambda index: OTHER_GPU)
    tuning.AUTOTUNER.choose = _no_timing
    heuristic = tuning.heuristic_pick("forward", 128, configs)
    assert tuning.launch_with_best(GRID_KEY, lambda: configs, lambda c: None) == heuristic
    assert tuning.chosen_configs()[tuning.key_text(GRID_KEY)][1] == "heuristic"


def test_without_a_winner_the_heuristic_pick_runs_untimed(tuner, monkeypatch):
    configs = [c for c in tuning.CANDIDATES["forward"] if not c.gluon]
    for setting in (None, "0"):
        if setting is not None:
            monkeypatch.setenv("ATTNZOO_AUTOTUNE", setting)
        tuner.best.clear()
        tuner.choose = _no_timing
        launched = []
        cfg = tuning.launch_with_best(OFF_GRID_KEY, lambda: configs, launched.append)
        assert launched == [cfg] == [KernelConfig(128, 128, 8, 3)]  # the D = 128 rule without Gluon
    assert not list(Path(os.environ["ATTNZOO_CACHE_DIR"]).glob("*.json"))  # heuristic picks are not stored


def test_tuning_when_asked_resets_before_every_launch_and_stores_the_winner(tuner, monkeypatch):
    monkeypatch.setenv("ATTNZOO_AUTOTUNE", "1")
    configs = [KernelConfig(64, 64, 4, 2), KernelConfig(128, 64, 8, 2)]
    events: list = []
    tuner.choose = _fake_timing(configs[1], events)
    buffer = torch.zeros(1)

    def launch(cfg):  # accumulates like the atomic backward: a launch without its reset would double the sum
        buffer.add_(1.0)
        events.append(("launch", float(buffer)))

    def reset():
        buffer.zero_()

    key = ("atomic:preprocess", 64, torch.float16, True, False, 64, 64, "ieee", 0)
    assert tuning.launch_with_best(key, lambda: configs, launch, reset) == configs[1]
    assert all(value == 1.0 for kind, value in events if kind == "launch") and float(buffer) == 1.0
    assert Autotuner().store.winners(H100)[tuning.key_text(key)] == str(configs[1])
    # A later process finds it on disk and times nothing.
    monkeypatch.setattr(tuning, "AUTOTUNER", Autotuner())
    tuning.AUTOTUNER.choose = _no_timing
    assert tuning.launch_with_best(key, lambda: configs, launch, reset) == configs[1]


def test_autotuning_context_times_despite_stored_winners(tuner):
    configs = tuning.CANDIDATES["forward"]
    tuner.choose = _no_timing
    shipped = tuning.launch_with_best(GRID_KEY, lambda: configs, lambda c: None)
    events: list = []
    winner = KernelConfig(64, 64, 4, 3)
    assert winner != shipped
    tuner.choose = _fake_timing(winner, events)
    with tuning.autotuning():
        assert tuning.launch_with_best(GRID_KEY, lambda: configs, lambda c: None, lambda: None) == winner
    assert events and tuner.sources[GRID_KEY] == "timed"
    assert tuner.store.winners(H100)[tuning.key_text(GRID_KEY)] == str(winner)
    with tuning.autotuning(enabled=False):
        assert not tuning.autotune_enabled()


def test_autotuning_of_some_kernels_leaves_the_others_to_their_stored_winners(tuner):
    """``autotuning(kernels=("dq",))`` (``python -m attnzoo tune --kernels dq``) times the dQ kernel's keys only: a
    forward key keeps its shipped winner, untimed."""
    dq_key = ("dq", *GRID_KEY[1:])
    events: list = []
    winner = KernelConfig(64, 64, 4, 3)
    tuner.choose = _fake_timing(winner, events)
    with tuning.autotuning(kernels=("dq",)):
        forward = tuning.launch_with_best(GRID_KEY, lambda: tuning.CANDIDATES["forward"], lambda c: None)
        assert tuner.sources[GRID_KEY] == "shipped" and not events
        assert tuning.launch_with_best(dq_key, lambda: tuning.CANDIDATES["dq"], lambda c: None, lambda: None) == winner
    assert events and tuner.sources[dq_key] == "timed" and tuner.sources[GRID_KEY] == "shipped"
    assert str(forward) == tuning.shipped_winners(H100)[tuning.key_text(GRID_KEY)]


def test_shipped_table_reads_back_from_the_logs(tmp_path):
    """The shipped H100 table is what bench/ship_tuning.py makes of the committed logs it names (the dense grids,
    the packed keys' tuning, the FP8 bench, the short-forward and D = 256 runs, the dQ kernel's tuning, the D = 256
    forward's retune with the 128-row Gluon tile, the dK/dV kernel's retune, the packed D = 64 forward's retune, the
    atomic kernel's D = 64 retune with its warp-specialised five-product block, the soft cap's and the sliding windows'
    keys, and the short and windowed forwards' retune with the persistent block's second set of Q slots), and its
    configs are all current candidates."""
    shipped = json.loads((ROOT / "attnzoo" / "tuning_data" / "nvidia-h100-80gb-hbm3.json").read_text())
    sources = shipped["source"].split(", ")
    assert sources == [
        "h100_bench_fp16.log",
        "h100_bench_bf16.log",
        "h100_varlen_tuning.log",
        "h100_fp8.log",
        "h100_short_fwd.log",
        "h100_short_fwd_d64.log",
        "h100_d256.log",
        "h100_d256_fwd.log",
        "h100_dq_tuning.log",
        "h100_d256_fwd_ws.log",
        "h100_dkdv_tuning_d64.log",
        "h100_dkdv_tuning_d128.log",
        "h100_varlen_fwd_tuning_d64.log",
        "h100_dkdv_tuning_d64_m128.log",
        "h100_dkdv_tuning_d64_packed.log",
        "h100_atomic_tuning_d64_ws.log",
        "h100_d256_wide_bf16.log",
        "h100_d256_wide_fp16.log",
        "h100_softcap_tuning.log",
        "h100_window_tuning.log",
        "h100_short_fwd_q_slots.log",
        "h100_window_tuning_q_slots.log",
    ]
    winners = tuning.write_shipped_table([ROOT / "bench" / "results" / s for s in sources], H100.name, tmp_path / "t")
    assert shipped["gpu"] == H100.name and shipped["winners"] == winners
    # 200 dense keys (fp16/bf16, D 64/128, 5 N buckets, causal or not: forward, dq, dkdv and the atomic kernel with
    # either Delta), and 32 packed ones (fp16/bf16, D 64/128, the 4k bucket, causal or not: forward, dq, dkdv and the
    # atomic kernel with Delta precomputed, as `tune` runs it), 6 FP8 forward ones (D 128, 4k-16k, causal or not), and
    # 36 at D = 256 (the forward, dQ and dK/dV at fp16/bf16, N 2k, 8k and 16k, causal or not).  The
    # short-forward logs retune keys the grids have, and so do the dQ kernel's tuning (its Gluon configs; dense and
    # packed keys), the dK/dV kernel's (dense keys, and at D = 64 packed ones with the 128-row tile) and the packed
    # D = 64 forward's; 24 soft-capped ones (forward, dq and dkdv at fp16/bf16, D = 128, N 4k and 16k, causal or
    # not) and 64 with a causal sliding window (forward, dq, dkdv and atomic at fp16/bf16, D = 128: spans 256 and 1024
    # at N 4k-16k, 4096 at 8k and 16k).  The last two logs retune forward keys the table has (D = 128 at N 1k and 2k;
    # the windows of 1024 keys).
    assert len(winners) == 362 and sum(" varlen" in key for key in winners) == 32
    assert sum("float8_e4m3fn" in key for key in winners) == 6 and sum("BLOCK_D=256" in key for key in winners) == 36
    assert sum(key.endswith(" softcap") for key in winners) == 24 and sum(" window<=" in key for key in winners) == 64
    for text, cfg in winners.items():
        assert KernelConfig.parse(cfg) in tuning.CANDIDATES[text.split()[0].split(":")[0]], (text, cfg)


def test_import_without_triton():
    """attnzoo imports and runs its PyTorch backends where Triton is not installed; the Triton backends stay
    registered and say why they cannot run."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, attnzoo\n"
        "assert 'triton_2kernel' in attnzoo.names() and 'triton_atomic' in attnzoo.names()\n"
        "q = torch.randn(1, 2, 8, 16)\n"
        "o = attnzoo.attention(q, q, q, causal=True, backend='torch_fa2')\n"
        "assert o.shape == q.shape\n"
        "for name in ('triton_2kernel', 'triton_atomic'):\n"
        "    reasons = attnzoo.get(name).not_supported_reasons(q, q, q)\n"
        "    assert reasons and reasons[0].startswith('Triton is not installed'), reasons\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_the_untimed_dkdv_pick_at_d64_is_the_128_row_gluon_tile_except_with_a_soft_cap(tuner, monkeypatch):
    """Head-dim tile 64 and no stored winner (here: score-modified keys, which the shipped table lacks): the dK/dV
    kernel takes the Gluon tile of 128 query rows (within 8% of the winner at every dense key of the H100's tuning),
    but not with a soft cap, where it spills: the 64-row Gluon tile there; without Gluon, the Triton tile of the list.
    At tile 128 the pick stays the 64-row Gluon tile."""
    monkeypatch.setattr(tuning, "shared_memory_limit", lambda device: 232_448)  # an H100's
    configs = tuning.candidates("dkdv", 64, torch.float16, torch.device("cpu"))
    triton_only = [c for c in configs if not c.gluon]
    assert str(tuning.heuristic_pick("dkdv", 64, triton_only, softcap=True)) == "64x64 w4 s3"
    wide = tuning.candidates("dkdv", 128, torch.float16, torch.device("cpu"))
    assert str(tuning.heuristic_pick("dkdv", 128, wide, softcap=True)) == "64x64 w4 s2 gluon"
    for modifiers, expected in (
        ("window alibi", "128x64 w4 s2 gluon"),
        ("softcap", "64x64 w4 s2 gluon"),
        ("window softcap alibi", "64x64 w4 s2 gluon"),
    ):
        key = ("dkdv", 64, torch.float16, True, False, 16384, 16384, "ieee", modifiers, "", "", 0)
        assert str(tuning.launch_with_best(key, lambda: configs, lambda c: None)) == expected
        assert tuner.sources[key] == "heuristic"

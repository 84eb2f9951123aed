"""jax_moe.tuning: the hardware descriptor, the tile rule and the table lookup."""

import json
from pathlib import Path

import jax.numpy as jnp
import pytest

import jax_moe
from conftest import ON_GPU
from jax_moe import fp8, tuning


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("sm90", [False, True])
def test_default_rule_by_rows_per_expert(sm90, tma):
    rule = lambda m, e: tuning.default_tile_m(m, e, sm90=sm90, tma=tma)  # noqa: E731
    decode = 16 if tma else 8
    assert rule(8, 128) == decode          # decode: T=1, k=8
    assert rule(128, 128) == decode        # T=16, k=8: one row per expert
    assert rule(1024, 128) == decode       # T=128: 8 rows per expert
    # above 8 rows per expert the sm90 kernel where it runs, else mma.sync
    # tiles: 64 rows up to 48 rows per expert, 128 beyond
    assert rule(1025, 128) == (256 if sm90 else 64)
    assert rule(8192, 256) == (256 if sm90 else 64)    # T=1024, DeepSeek-V3: 32 rows
    assert rule(6144, 128) == (256 if sm90 else 64)    # 48 rows
    assert rule(6145, 128) == (256 if sm90 else 128)
    assert rule(8192, 128) == (256 if sm90 else 128)   # T=1024: 64 rows
    assert rule(65536, 128) == (256 if sm90 else 128)  # T=8192: 512 rows
    tiles = [rule(m, 64) for m in (1, 10, 100, 1000, 10_000, 100_000)]
    assert tiles == sorted(tiles)  # never a smaller tile for more rows


def test_default_rule_asks_the_device_when_not_told():
    assert tuning.default_tile_m(65536, 128) == (256 if tuning.sm90_device() else 128)
    assert tuning.default_tile_m(8, 128) == (16 if tuning.tma_decode_device() else 8)


def test_tma_decode_shape_rule():
    if not ON_GPU:
        assert not tuning.tma_decode_device()
        assert not tuning.tma_decode_usable(4096, jnp.bfloat16)
    usable = tuning.tma_decode_device()
    assert tuning.tma_decode_usable(4096, jnp.bfloat16) == usable
    assert tuning.tma_decode_usable(136, jnp.float16) == usable
    assert not tuning.tma_decode_usable(4096, jnp.float32)
    assert not tuning.tma_decode_usable(132, jnp.bfloat16)   # K % 8
    assert not tuning.tma_decode_usable(0, jnp.bfloat16)


def test_sm90_shape_rule():
    assert tuning.sm90_shape_ok(136, 200, jnp.bfloat16) and tuning.sm90_shape_ok(8, 8, jnp.float16)
    assert not tuning.sm90_shape_ok(136, 200, jnp.float32)
    assert not tuning.sm90_shape_ok(130, 200, jnp.bfloat16)   # N % 8
    assert not tuning.sm90_shape_ok(136, 204, jnp.bfloat16)   # K % 8
    assert not tuning.sm90_shape_ok(136, 0, jnp.bfloat16)
    if not jax_moe.HAS_SM90_GEMM or not ON_GPU:
        assert not tuning.sm90_device() and not tuning.sm90_usable(136, 200, jnp.bfloat16)


def test_wgmma_rule_rows_and_shape_limits(monkeypatch):
    """The own Hopper kernel's rule: at most WGMMA_MAX_AVG_ROWS (128) rows an
    expert on average, at most 1024 experts, experts * n within int32, n and
    k multiples of 8, with the activation n a multiple of 16."""
    monkeypatch.setattr(tuning, "sm90_usable", lambda n, k, dtype: True)
    bf16 = jnp.bfloat16
    runs = lambda m, e, n, k, act=False: tuning.wgmma_runs(m, e, n, k, bf16, act=act)  # noqa: E731
    assert tuning.WGMMA_MAX_AVG_ROWS == 128
    assert runs(1, 1, 8, 8) and runs(128 * 4, 4, 256, 64) and not runs(128 * 4 + 1, 4, 256, 64)
    assert not runs(0, 4, 256, 64) and not runs(8, 0, 256, 64)
    assert runs(1024, 1024, 256, 64) and not runs(1025, 1025, 256, 64)    # experts
    assert runs(8, 8, (2**31 - 1) // 8 // 8 * 8, 64)                     # experts * n < 2^31
    assert not runs(8, 8, 2**28, 64)
    assert not runs(8, 1, 260, 64) and not runs(8, 1, 256, 60)            # n, k % 8
    fits = jax_moe._ffi._ext.wgmma_fits  # the kernel's shape limits alone: m within int32
    assert fits(2**31 - 1, 8, 8, 1, False) and not fits(2**31, 8, 8, 1, False)
    assert not runs(8, 1, 8, 2**31 + 8)                                   # k within int32
    assert runs(8, 1, 264, 64) and not runs(8, 1, 264, 64, act=True)      # act: n % 16
    assert tuning.group_gemm_act_runs(8, 1, 272, 64, bf16)
    assert not tuning.group_gemm_act_runs(8, 1, 264, 64, bf16)
    monkeypatch.setattr(tuning, "sm90_usable", lambda n, k, dtype: False)
    assert not runs(8, 1, 256, 64) and not tuning.group_gemm_act_runs(8, 1, 256, 64, bf16)


def test_explicit_tile_m_wins_and_is_checked():
    assert tuning.group_gemm_tile_m(65536, 128, 3072, 4096, jnp.bfloat16, 8) == 8
    assert tuning.group_gemm_tile_m(8, 128, 30, 40, jnp.float32, 256) == 256  # the handler falls back
    with pytest.raises(ValueError, match="tile_m"):
        tuning.group_gemm_tile_m(8, 8, 8, 8, jnp.bfloat16, 48)


@pytest.fixture
def fake_table(tmp_path, monkeypatch):
    """install(entries, sm90, tma): a table for "Fake GPU 9000" with `entries`
    under bf16/E16/N96/K64, that GPU as JAX's device, and the sm90 and TMA
    decode kernels usable or not; returns pick(m), the table-driven tile_m."""
    kind = "Fake GPU 9000"

    def install(entries, sm90, tma):
        table = {"device": kind, "group_gemm": {tuning.table_key(16, 96, 64, jnp.bfloat16): entries}}
        monkeypatch.setenv("JAX_MOE_TUNING_DIR", str(tmp_path))
        (tmp_path / "Fake_GPU_9000.json").write_text(json.dumps(table))
        tuning.load_table.cache_clear()
        monkeypatch.setattr(tuning, "_device_kind", lambda: kind)
        monkeypatch.setattr(tuning, "sm90_usable", lambda n, k, dtype: sm90)
        monkeypatch.setattr(tuning, "tma_decode_usable", lambda k, dtype: tma)
        return lambda m: tuning.group_gemm_tile_m(m, 16, 96, 64, jnp.bfloat16)

    yield install
    tuning.load_table.cache_clear()


def test_table_lookup_nearest_bucket(fake_table, tmp_path):
    pick = fake_table([[16, 64], [1024, 8], [65536, 32]], sm90=False, tma=False)
    assert tuning.table_path("Fake GPU 9000") == tmp_path / "Fake_GPU_9000.json"
    assert pick(10) == 64 and pick(16) == 64
    assert pick(900) == 8 and pick(2000) == 8
    assert pick(40_000) == 32 and pick(10**7) == 32
    # another problem or dtype: the rule
    assert (tuning.group_gemm_tile_m(10, 16, 96, 64, jnp.float16) ==
            tuning.default_tile_m(10, 16, tma=False))


@pytest.mark.parametrize("usable", [False, True])
def test_table_answer_128_yields_to_sm90(fake_table, usable):
    pick = fake_table([[16, 64], [128, 128], [1024, 128], [4096, 32], [65536, 128]],
                      sm90=usable, tma=False)
    assert pick(16) == 64
    assert pick(128) == 128                       # 8 rows per expert: not above DECODE_MAX_ROWS
    assert pick(1024) == (256 if usable else 128)  # 64 rows per expert
    assert pick(4096) == 32                       # a table answer other than 128 stands
    assert pick(65536) == (256 if usable else 128)  # 4096 rows per expert
    assert tuning.group_gemm_tile_m(65536, 16, 96, 64, jnp.bfloat16, 128) == 128  # explicit
    # not in the table: the rule, told whether the kernel is usable
    assert tuning.group_gemm_tile_m(65536, 16, 96, 64, jnp.float16) == (256 if usable else 128)


@pytest.mark.parametrize("usable", [False, True])
def test_table_answer_8_yields_to_tma_decode(fake_table, usable):
    pick = fake_table([[8, 8], [128, 8], [1024, 32], [65536, 128]], sm90=False, tma=usable)
    assert pick(8) == (16 if usable else 8) and pick(128) == (16 if usable else 8)
    assert pick(1024) == 32 and pick(65536) == 128  # other answers stand
    assert tuning.group_gemm_tile_m(8, 16, 96, 64, jnp.bfloat16, 8) == 8  # explicit
    # not in the table: the rule, told whether the kernel is usable
    assert tuning.group_gemm_tile_m(8, 16, 96, 64, jnp.float16) == (16 if usable else 8)


def test_tune_keeps_the_rules_choice_within_noise():
    from jax_moe import tune
    assert tune.best_tile({8: 37.6, 32: 37.3, 64: 36.8, 128: 38.2}, 8) == 8  # within 3%
    assert tune.best_tile({8: 40.0, 64: 36.8}, 8) == 64
    assert tune.best_tile({64: 36.8, 128: 38.0}, 8) == 64  # the rule's tile was not timed


def test_tune_runs_every_call(rng):
    # Calls that share a routing must not be merged by XLA (CSE): each one
    # has to reach the compiled program, else tune divides the time of a
    # few calls by all of them.
    from jax_moe import tune
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, 24, 32)), jnp.bfloat16)
    sizes = jnp.asarray([[4, 4, 4, 4], [16, 0, 0, 0]], jnp.int32)
    hlo = tune.gemm_loop(64, 6).lower(x, w, sizes).compile().as_text()
    assert hlo.count('custom_call_target="jax_moe_group_gemm"') == 6


def test_shipped_tables_are_well_formed():
    paths = sorted(tuning._TABLE_DIR.glob("*.json"))
    assert tuning._TABLE_DIR / "NVIDIA_H200.json" in paths  # installed with the package
    for path in paths:
        data = json.loads(path.read_text())
        assert data["device"] and data["group_gemm"], path
        for key, entries in data["group_gemm"].items():
            assert key.count("/") == 3, key
            for m, tile in entries:
                assert m >= 1 and tile in tuning.TILE_M, (path, key)
        for key, entries in data.get("group_gemm_fp8", {}).items():
            assert key.count("/") == 3, key
            for m, tile in entries:
                assert m >= 1 and tile in tuning.FP8_TILE_M, (path, key)


def test_hardware_descriptor():
    hw = tuning.hardware()
    if not (jax_moe.HAS_CUDA and ON_GPU):
        # No CUDA in the build: None. CUDA built but no GPU: None as well.
        assert hw is None or hw["sm_count"] > 0
        return
    assert hw["sm_count"] > 0 and hw["l2_bytes"] > 0 and hw["smem_per_block_optin"] >= 48 * 1024
    assert hw["compute_capability"][0] >= 8
    assert hw["name"]


def test_tune_needs_a_gpu(capsys):
    if ON_GPU:
        pytest.skip("on a GPU this would tune (minutes)")
    from jax_moe import tune
    assert tune.main(["--shapes", "qwen3_30b_a3b", "--tokens", "1"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


@pytest.mark.parametrize("fp8_mode", [False, True], ids=["bf16", "fp8"])
def test_tune_keeps_the_section_it_does_not_time(monkeypatch, tmp_path, fp8_mode):
    # tune's write on a stand-in GPU (its timing loop is the test above's):
    # the section it times and that section's date and timings replace the
    # file's, the other GEMM's section, date and timings stay as they were,
    # and no temporary file is left behind.
    import datetime
    import types
    from jax_moe import tune
    fake = types.SimpleNamespace(platform="gpu", device_kind="Fake GPU 9000")
    monkeypatch.setattr(tune.jax, "devices", lambda: [fake])
    monkeypatch.setattr(tuning, "hardware", lambda device=0: {"name": "Fake GPU 9000"})
    key = tuning.table_key(8, 64, 32, jnp.bfloat16)
    timed = {key: [[2, 64], [32, 128]]}
    for name in ("_tune_bf16", "_tune_fp8"):
        section = "group_gemm_fp8" if name == "_tune_fp8" else "group_gemm"
        monkeypatch.setattr(tune, name, lambda args, section=section:
                            (section, timed, {key: {"2": {"64": 1.0}}}))
    out = tmp_path / "Fake_GPU_9000.json"
    old = {"device": "Fake GPU 9000", "jax": "0.0", "date": "2026-01-01",
           "date_fp8": "2026-01-02", "group_gemm": {key: [[2, 16]]},
           "group_gemm_fp8": {key: [[2, 8]]}, "timings_us": {"old": 1},
           "timings_us_fp8": {"old": 2}}
    out.write_text(json.dumps(old))
    assert tune.main(["--out", str(out)] + (["--fp8"] if fp8_mode else [])) == 0
    data = json.loads(out.read_text())
    suffix, kept = ("_fp8", "") if fp8_mode else ("", "_fp8")
    timed_section, kept_section = "group_gemm" + suffix, "group_gemm" + kept
    assert data[timed_section] == timed
    assert data["timings_us" + suffix] == {key: {"2": {"64": 1.0}}}
    assert data["date" + suffix] == datetime.date.today().isoformat()
    assert data[kept_section] == old[kept_section]
    assert data["timings_us" + kept] == old["timings_us" + kept]
    assert data["date" + kept] == old["date" + kept]
    assert data["hardware"] == {"name": "Fake GPU 9000"} and data["jax"] != "0.0"
    assert [f.name for f in tmp_path.iterdir()] == ["Fake_GPU_9000.json"]


def test_malformed_table_raises_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_MOE_TUNING_DIR", str(tmp_path))
    (tmp_path / "Broken_GPU.json").write_text('{"group_gemm": {"bfloat16/E8/N8/K8": [[16, 48]]}}')
    tuning.load_table.cache_clear()
    try:
        with pytest.raises(ValueError, match="Broken_GPU.json"):
            tuning.load_table("Broken GPU")
    finally:
        tuning.load_table.cache_clear()


@pytest.mark.parametrize("text, where", [
    ('{"group_gemm": null}', '"group_gemm"'),
    ('{"tables": {}}', '"group_gemm"'),
    ('[1, 2]', '"group_gemm"'),
    ('{"group_gemm": {"bfloat16/E8/N8/K8": [[Infinity, 128]]}}', "m=inf"),
    ('{"group_gemm": {"bfloat16/E8/N8/K8": [[16, 8.5]]}}', "tile_m=8.5"),
    ('{"group_gemm": {"bfloat16/E8/N8/K8": [[16, 128.0]]}}', "tile_m=128.0"),
    ('{"group_gemm": {"bfloat16/E8/N8/K8": [[true, 128]]}}', "m=True"),
    ('{"group_gemm": {"bfloat16/E8/N8/K8": [[0, 128]]}}', "m=0"),
    ('{"group_gemm": {"bfloat16/E8/N8/K8": [[16]]}}', "must be a pair"),
    ('{"group_gemm": {"bfloat16/E8/N8/K8": []}}', "non-empty list"),
    ('{"group_gemm": {"bfloat16/E8/N8/K8": 5}}', "non-empty list"),
    ('{"group_gemm": ', "not JSON"),
])
def test_table_checked_whole_naming_file_and_key(tmp_path, monkeypatch, text, where):
    monkeypatch.setenv("JAX_MOE_TUNING_DIR", str(tmp_path))
    (tmp_path / "Broken_GPU.json").write_text(text)
    tuning.load_table.cache_clear()
    try:
        with pytest.raises(ValueError, match="Broken_GPU.json") as info:
            tuning.load_table("Broken GPU")
        assert where in str(info.value)
        if "E8" in text and "null" not in text and "not JSON" not in where:
            assert "bfloat16/E8/N8/K8" in str(info.value)
    finally:
        tuning.load_table.cache_clear()


def test_shipped_tables_pass_the_check():
    for path in (Path(tuning.__file__).parent / "tuning_tables").glob("*.json"):
        table = tuning._checked_table(json.loads(path.read_text()), path)
        assert table


def test_fp8_rule_by_rows_per_expert():
    assert tuning.default_fp8_tile_m(1, 8) == 8 and tuning.default_fp8_tile_m(16, 8) == 8
    assert tuning.default_fp8_tile_m(17, 8) == 64        # past 2 rows an expert
    assert tuning.default_fp8_tile_m(1023, 8) == 64      # under 128 rows an expert
    assert tuning.default_fp8_tile_m(1024, 8) == 128
    assert tuning.default_fp8_tile_m(0, 0) == 8


def test_fp8_explicit_tile_m_wins_and_is_checked():
    assert tuning.group_gemm_fp8_tile_m(65536, 128, 3072, 4096, jnp.bfloat16, 8) == 8
    with pytest.raises(ValueError, match="tile_m"):
        tuning.group_gemm_fp8_tile_m(8, 8, 8, 8, jnp.bfloat16, 16)


def test_fp8_decode_runs():
    assert tuning.fp8_decode_runs(8, 256, 7168)
    assert not tuning.fp8_decode_runs(64, 256, 7168)
    assert not tuning.fp8_decode_runs(8, 256, 7160)        # K not a multiple of 16
    assert not tuning.fp8_decode_runs(8, 256, 128 * 160)   # past its shared memory
    # 8 (E + 1) + 8 * 132 * ceil(K / 128) bytes against 160 KiB: the edges
    assert tuning.fp8_decode_runs(8, 256, 153 * 128)
    assert not tuning.fp8_decode_runs(8, 256, 154 * 128)
    assert tuning.fp8_decode_runs(8, 13087, 7168)
    assert not tuning.fp8_decode_runs(8, 13088, 7168)


def _install_table(tmp_path, monkeypatch, table):
    kind = "Fake GPU 9000"
    monkeypatch.setenv("JAX_MOE_TUNING_DIR", str(tmp_path))
    (tmp_path / "Fake_GPU_9000.json").write_text(json.dumps(dict(table, device=kind)))
    tuning.load_table.cache_clear()
    monkeypatch.setattr(tuning, "_device_kind", lambda: kind)


def test_fp8_table_lookup(tmp_path, monkeypatch):
    key = tuning.table_key(16, 96, 64, jnp.bfloat16)
    _install_table(tmp_path, monkeypatch, {"group_gemm": {key: [[16, 64]]},
                                           "group_gemm_fp8": {key: [[16, 64], [4096, 8]]}})
    try:
        pick = lambda m, dtype=jnp.bfloat16: tuning.group_gemm_fp8_tile_m(m, 16, 96, 64, dtype)
        assert pick(10) == 64 and pick(5000) == 8  # the table, however many rows
        assert pick(10, jnp.float32) == tuning.default_fp8_tile_m(10, 16)  # not listed: the rule
        assert tuning.group_gemm_fp8_tile_m(5000, 16, 96, 64, jnp.bfloat16, 128) == 128
    finally:
        tuning.load_table.cache_clear()


def test_fp8_section_is_optional_and_checked(tmp_path, monkeypatch):
    key = tuning.table_key(16, 96, 64, jnp.bfloat16)
    _install_table(tmp_path, monkeypatch, {"group_gemm": {key: [[16, 64]]}})
    try:
        assert tuning.load_table("Fake GPU 9000", "group_gemm_fp8") == {}
        assert tuning.group_gemm_fp8_tile_m(40, 16, 96, 64, jnp.bfloat16) == 64  # the rule
        _install_table(tmp_path, monkeypatch, {"group_gemm": {key: [[16, 64]]},
                                               "group_gemm_fp8": {key: [[16, 16]]}})
        with pytest.raises(ValueError, match="group_gemm_fp8") as info:
            tuning.load_table("Fake GPU 9000", "group_gemm_fp8")
        assert "tile_m=16" in str(info.value) and "Fake_GPU_9000.json" in str(info.value)
    finally:
        tuning.load_table.cache_clear()


def test_tune_runs_every_fp8_call(rng):
    from jax_moe import tune
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
    w = fp8.quantize_blocks(jnp.asarray(rng.standard_normal((4, 24, 32)), jnp.float32))
    sizes = jnp.asarray([[4, 4, 4, 4], [16, 0, 0, 0]], jnp.int32)
    hlo = tune.gemm_loop(64, 6, fp8_weights=True).lower(x, w, sizes).compile().as_text()
    assert hlo.count('custom_call_target="jax_moe_group_gemm_fp8"') == 6


@pytest.mark.parametrize("fp8_mode", [False, True], ids=["bf16", "fp8"])
def test_tune_loop_writes_a_checked_section(monkeypatch, tmp_path, fp8_mode):
    # The timing loop on a tiny shape (any backend: on the CPU every tile is
    # the one CPU kernel): one entry per token count, tiles the section allows,
    # and a section that passes the table check.
    import argparse
    from jax_moe import tune
    monkeypatch.setattr(tune, "SHAPES", {"tiny": (64, 32, 8, 2)})
    args = argparse.Namespace(shapes=["tiny"], tokens=[1, 16], dtype="bfloat16", calls=2,
                              repeats=1, tiles=None, fp8=fp8_mode)
    section, table, timings = (tune._tune_fp8 if fp8_mode else tune._tune_bf16)(args)
    assert section == ("group_gemm_fp8" if fp8_mode else "group_gemm")
    assert set(table) == {tuning.table_key(8, 64, 64, jnp.bfloat16),
                          tuning.table_key(8, 64, 32, jnp.bfloat16)}
    for key, entries in table.items():
        assert [m for m, _ in entries] == [2, 32] and set(timings[key]) == {2, 32}
    data = {"group_gemm": table} if not fp8_mode else {"group_gemm": {"k": [[1, 8]]},
                                                       section: table}
    assert tuning._checked_table(data, tmp_path / "t.json", section) == table


def test_a_table_of_one_section(tmp_path, monkeypatch):
    # `tune --fp8` into a new file writes only the fp8 section: the other
    # GEMM then has no entries (the rule), the fp8 section is read.
    key = tuning.table_key(16, 96, 64, jnp.bfloat16)
    _install_table(tmp_path, monkeypatch, {"group_gemm_fp8": {key: [[16, 128]]}})
    try:
        assert tuning.load_table("Fake GPU 9000") == {}
        assert tuning.load_table("Fake GPU 9000", "group_gemm_fp8") == {key: [[16, 128]]}
        assert tuning.group_gemm_fp8_tile_m(16, 16, 96, 64, jnp.bfloat16) == 128
    finally:
        tuning.load_table.cache_clear()

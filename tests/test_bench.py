"""The bench scripts' own logic (bench/ is scripts, not a package).

bench/e2e.py's token ban for the llama-servers that answer HTTP 500 to invalid UTF-8:
the October 2026 llama-server parses every answer with its chat parser and fails with
"does not match the expected Content-only format" when a random-weight model emits
tokens that are not whole UTF-8 (reproduced with the prebuilt Vulkan llama-server on
lavapipe). ``Prompts.partial_utf8`` lists those tokens from the GGUF vocabulary; these
tests hold it to the vocabulary's own bytes, read without trio-llm's tokenizer. And
bench/common.py's records keep the settings they ran under.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import e2e  # noqa: E402  (bench/ is scripts, not a package)


def _vocab(path: Path) -> tuple[list[str], list[int]]:
    r = gguf.GGUFReader(str(path), "r")
    return list(r.fields["tokenizer.ggml.tokens"].contents()), list(r.fields["tokenizer.ggml.token_type"].contents())


def test_spm_bans_exactly_the_high_byte_tokens(tiny_spm_model: Path) -> None:
    tokens, types = _vocab(tiny_spm_model)
    high = {i for i, (t, k) in enumerate(zip(tokens, types, strict=True))
            if k == int(gguf.TokenType.BYTE) and int(t[3:5], 16) >= 0x80}
    assert len(high) == 128
    assert set(e2e.Prompts(tiny_spm_model, 0, "hello").partial_utf8()) == high


def test_byte_level_bans_lone_high_bytes_and_nothing_whole(tiny_model: Path) -> None:
    from trio_llm.model.vocab import gpt2_byte_chars

    tokens, _ = _vocab(tiny_model)
    chars = gpt2_byte_chars()  # byte b is written as chars[b] in a byte-level BPE vocabulary
    index = {t: i for i, t in enumerate(tokens)}
    banned = set(e2e.Prompts(tiny_model, 0, "hello").partial_utf8())
    lone_high = {index[chars[b]] for b in range(0x80, 0x100)}
    assert lone_high <= banned
    ascii_ids = {index[chars[b]] for b in range(0x20, 0x7F)}
    assert not ascii_ids & banned
    to_byte = {c: b for b, c in enumerate(chars)}
    for i in banned:  # every banned token's bytes are invalid alone
        raw = bytes(to_byte[c] for c in tokens[i])
        with pytest.raises(UnicodeDecodeError):
            raw.decode("utf-8")


def test_the_ban_goes_into_the_request_body() -> None:
    b = e2e.body([1, 2, 3], 8, False, [300, 301])
    assert b["logit_bias"] == [[300, False], [301, False]]
    assert "logit_bias" not in e2e.body([1, 2, 3], 8, False)


def test_records_keep_the_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every bench record keeps the TRIO_LLM_* (and Vulkan loader) environment it ran
    under, so the two sides of an A/B through a setting are told apart by the record."""
    import json

    import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setenv("TRIO_LLM_MATVEC_UNROLL", "8")
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("UNRELATED_SETTING", "x")
    record = json.loads(common.write_result("probe", {"a": 1}, {"b": 2}).read_text())
    assert record["settings"]["TRIO_LLM_MATVEC_UNROLL"] == "8"
    assert record["settings"]["GGML_VK_VISIBLE_DEVICES"] == "0"
    assert "UNRELATED_SETTING" not in record["settings"]
    assert record["params"] == {"a": 1} and record["figures"] == {"b": 2}


def test_lcpp_ops_sums_ggml_vulkans_timing_blocks() -> None:
    """bench/lcpp_ops.py reads ggml-vulkan's GGML_VK_PERF_LOGGER blocks (lines as the
    prebuilt llama-server printed them on lavapipe): per op name the counts and
    microseconds of every block added up, FLOPs from the GFLOPS/s where printed, the
    kinds without their shapes; lines outside a block are not ops."""
    import lcpp_ops

    block = """----------------
Vulkan Timings:
ADD: 3 x 27936.3 us = 83808.8 us
FLASH_ATTN_EXT dst(64,4,2,1),  q(64,2,4,1),  k(64,256,2,1),  v(64,256,2,1),  m(256,2,1,1): 2 x 665125 us = 1.33025e+06 us (0.000788255 GFLOPS/s)
MUL_MAT_ADD MUL_MAT_VEC q8_0 m=256 n=1 k=512: 1 x 553.611 us = 553.611 us (0.473054 GFLOPS/s)
MUL_MAT q8_0 m=2048 n=512 k=2048: 16 x 100 us = 1600 us (83886 GFLOPS/s)
Total time: 1.41618e+06 us.
srv  log_server_r: request: POST /completion 127.0.0.1 200
"""
    second = block.replace("ADD: 3 x 27936.3 us = 83808.8 us", "ADD: 1 x 10 us = 10 us")
    ops = lcpp_ops.parse_timings(block + "ADD: 9 x 1 us = 9 us\n" + second)
    assert ops["ADD"] == {"count": 4, "total_us": 83818.8, "flops": 0.0}  # the stray line after a block is not summed
    mm = ops["MUL_MAT q8_0 m=2048 n=512 k=2048"]
    assert mm["count"] == 32 and mm["total_us"] == 3200
    assert mm["flops"] == pytest.approx(2 * 83886e9 * 1600e-6)
    rows = {r["kind"]: r for r in lcpp_ops.by_kind(ops)}
    assert set(rows) == {"ADD", "FLASH_ATTN_EXT", "MUL_MAT_ADD MUL_MAT_VEC q8_0", "MUL_MAT q8_0"}
    assert rows["FLASH_ATTN_EXT"]["count"] == 4 and rows["ADD"]["tflops"] is None
    assert rows["MUL_MAT q8_0"]["tflops"] == pytest.approx(83.886)
    assert abs(sum(r["share"] for r in rows.values()) - 1) < 1e-9

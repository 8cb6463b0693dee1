"""The one HF writer (``hf_io.write_hf_dir``): what ``Policy.save_hf``, ``--export-hf`` and the SFT
warm start write, read back by the one reader (``hf_io.hf_getter``)."""

from __future__ import annotations

import json

import torch

from megatron_acrl.megatron.hf_io import hf_getter, write_hf_dir


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.mlp.weight": torch.randn(8, 4, generator=g) for i in range(3)}


def _read(path) -> dict[str, torch.Tensor]:  # noqa: ANN001
    get, close = hf_getter(path)
    try:
        return {name: get(name) for name in _weights()}
    finally:
        close()


def test_one_shard_with_config_keeps_the_dtype(tmp_path):
    weights = _weights()
    out = write_hf_dir(weights.items(), tmp_path / "hf", write=True, config={"model_type": "qwen2"})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text()) == {"model_type": "qwen2"}
    got = _read(out)
    assert all(torch.equal(got[k], v) for k, v in weights.items())


def test_base_dir_files_are_copied_and_its_weights_replaced(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "qwen2"}')
    (base / "tokenizer.json").write_text("{}")
    (base / "model.safetensors").write_text("stale weights, not copied")
    (base / "model.safetensors.index.json").write_text("{}")
    out = write_hf_dir(_weights().items(), tmp_path / "out", write=True, base_dir=base, dtype=torch.bfloat16)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json"]
    got = _read(out)
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in _weights().items())


def test_several_shards_get_an_index_and_a_rewrite_replaces_the_directory(tmp_path):
    out = tmp_path / "hf"
    write_hf_dir(_weights().items(), out, write=True, max_shard_bytes=1)
    (out / "leftover.txt").write_text("from an earlier export")
    write_hf_dir(_weights().items(), out, write=True, max_shard_bytes=200)  # two tensors a shard
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(index) == sorted(_weights()) and len(set(index.values())) == 2
    assert not (out / "leftover.txt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    got = _read(out)
    assert all(torch.equal(got[k], v) for k, v in _weights().items())


def test_a_cache_entry_another_writer_finished_first_is_kept_and_ours_discarded(tmp_path):
    """Two runs warm-starting the same SFT cache entry: the first to finish stays (the other may
    already serve it); each built its copy in a directory of its own, so neither touched the other's."""
    out = tmp_path / "sft-key"
    write_hf_dir(_weights().items(), out, write=True)
    other = {k: v + 1 for k, v in _weights().items()}
    write_hf_dir(other.items(), out, write=True, keep_existing=True)
    got = _read(out)
    assert all(torch.equal(got[k], v) for k, v in _weights().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft-key"]
    write_hf_dir(other.items(), out, write=True)  # without keep_existing: a rewrite replaces it
    assert all(torch.equal(_read(out)[k], v) for k, v in other.items())


def test_a_rank_that_does_not_write_walks_the_stream_and_writes_nothing(tmp_path):
    walked = []

    def stream():
        for item in _weights().items():
            walked.append(item[0])
            yield item

    out = write_hf_dir(stream(), tmp_path / "hf", write=False)
    assert walked == list(_weights()) and not out.exists()

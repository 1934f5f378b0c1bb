"""model.cache_prompt_embeddings: each distinct prompt encoded once over a run, the embeddings bit for bit those
of a run without the cache."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from flowgrpo.models.flux import FluxAdapter
from flowgrpo.records import PromptEmbeds
from flowgrpo.sampling.prompt_cache import PromptEmbedCache, encoder_identity
from tests.tiny_runs import _cfg, _rollouts

PROMPTS = ("a red cube", "a blue ball", "a green tree")


def _run_counting(tmp_path, tiny_flux_dir, name, cache: bool, monkeypatch) -> Counter:
    from flowgrpo.runner import run

    calls: Counter = Counter()
    real = FluxAdapter.encode_prompts

    def counting(self, prompts, *args, **kwargs):
        calls.update(prompts)
        return real(self, prompts, *args, **kwargs)

    monkeypatch.setattr(FluxAdapter, "encode_prompts", counting)
    cfg = _cfg(tmp_path, tiny_flux_dir, name, prompts=PROMPTS, model={"cache_prompt_embeddings": cache},
               train={"num_epochs": 3}, logging={"eval_every": 1})
    run(cfg)
    monkeypatch.setattr(FluxAdapter, "encode_prompts", real)
    return calls


def test_cached_run_encodes_each_prompt_once_and_matches_the_uncached_run(tmp_path, tiny_flux_dir, monkeypatch):
    cached = _run_counting(tmp_path, tiny_flux_dir, "cached", True, monkeypatch)
    plain = _run_counting(tmp_path, tiny_flux_dir, "plain", False, monkeypatch)
    # 3 epochs of 2 prompts out of 3, and an evaluation of 2 prompts each epoch: the encoder sees each prompt once
    assert set(cached) <= set(PROMPTS) and max(cached.values()) == 1
    assert sum(plain.values()) > sum(cached.values())  # without the cache they are encoded again and again
    for epoch in range(3):  # the trajectories (latents from the embeddings) and log-probs agree bit for bit
        a, b = _rollouts(tmp_path / "cached", epoch), _rollouts(tmp_path / "plain", epoch)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_cache_rows_are_the_encoders_rows_and_keys_name_the_encoder(tiny_flux):
    fresh = tiny_flux.encode_prompts(list(PROMPTS))
    cache = PromptEmbedCache(encoder_identity(tiny_flux, "tiny"))
    seen = []

    def encode(positions):
        seen.append(list(positions))
        return tiny_flux.encode_prompts([PROMPTS[i] for i in positions])

    got = cache.embeds(list(PROMPTS[:2]), encode, "cpu")
    got = cache.embeds(list(PROMPTS), lambda pos: encode(pos) if pos == [2] else pytest.fail(pos), "cpu")
    assert seen == [[0, 1], [2]] and cache.encoded == 3 and cache.hits == 2
    for k in fresh.tensors:
        assert torch.equal(got[k], fresh[k]), k
    # another encoding setting is another identity
    assert encoder_identity(tiny_flux, "tiny") != encoder_identity(tiny_flux, "other")
    old = tiny_flux.max_sequence_length
    tiny_flux.max_sequence_length = old + 1
    try:
        assert encoder_identity(tiny_flux, "tiny") != cache.identity
    finally:
        tiny_flux.max_sequence_length = old


def test_rows_of_other_lengths_are_refused_in_one_line():
    cache = PromptEmbedCache("x")
    cache.embeds(["a"], lambda pos: PromptEmbeds({"e": torch.zeros(1, 3)}), "cpu")
    with pytest.raises(ValueError, match="depend on the batch") as err:
        cache.embeds(["a", "b"], lambda pos: PromptEmbeds({"e": torch.zeros(1, 4)}), "cpu")
    assert "\n" not in str(err.value)


def test_sharded_encoders_refuse_the_cache(tiny_flux):
    from flowgrpo.sampling.prompt_cache import attach_prompt_cache

    with pytest.raises(ValueError, match="text_encoders device or offload, got 'shard'"):
        attach_prompt_cache(tiny_flux, "tiny", "shard")


def test_rows_on_disk_are_read_back_by_a_new_cache_and_checked(tiny_flux, tmp_path):
    ident = encoder_identity(tiny_flux, "tiny")
    first = PromptEmbedCache(ident, tmp_path)
    want = first.embeds(list(PROMPTS), lambda pos: tiny_flux.encode_prompts([PROMPTS[i] for i in pos]), "cpu")
    files = sorted((tmp_path / ident[:16]).glob("*.safetensors"))
    assert len(files) == 3 and not list((tmp_path / ident[:16]).glob("*.tmp"))
    second = PromptEmbedCache(ident, tmp_path)  # a later run: nothing encoded, every row read from disk
    got = second.embeds(list(PROMPTS[::-1]), lambda pos: pytest.fail(f"encoded {pos}"), "cpu")
    assert second.read == 3 and second.encoded == 0
    for k in want.tensors:
        assert torch.equal(got[k], want[k].flip(0)), k
    for k in want.shared:
        assert torch.equal(got[k], want[k]), k
    other = PromptEmbedCache(ident, tmp_path)
    files[0].write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=f"prompt embedding file {files[0]} cannot be read"):
        other.embeds(list(PROMPTS), lambda pos: tiny_flux.encode_prompts([PROMPTS[i] for i in pos]), "cpu")


def test_a_folder_without_the_cache_is_refused():
    from flowgrpo.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="prompt_embeddings_dir='x' is read only with model.cache_prompt_embeddings"):
        build_config({"model": {"prompt_embeddings_dir": "x"}})

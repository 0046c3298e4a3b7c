"""Peer `hf`: Hugging Face transformers `generate` with static batches.

This is "reuse the training stack": padded static batches, no KV management of our own. It is a
peer, not part of the engine: `run` and `compare` hand it the whole workload and it writes the
same per-request records and step stats servelab's engine does, so it is just another row.

`peer.cache`: `dynamic` (transformers' DynamicCache) or `static` (a StaticCache; transformers then
compiles the forward with CUDA graphs: its fastest path, and the strongest PyTorch peer on a GPU);
`auto` is static on CUDA, dynamic on the CPU. Dummy-weight models (`model.load_format=dummy`) are
built from the same shape with transformers' own random init.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from core.api import DTYPES, ConfigError, ModelConfig, PeerConfig, hookimpl, make_record


@dataclass
class HFPeerConfig(PeerConfig):
    cache: str = "auto"  # auto (static on CUDA, dynamic on the CPU) | dynamic | static


class _StepClock:
    """A generate() streamer that only notes when each decoding step's tokens appear."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFPeer:
    config_class = HFPeerConfig

    def __init__(self, config: HFPeerConfig) -> None:
        if config.cache not in ("auto", "dynamic", "static"):
            raise ConfigError(f"peer.cache must be auto, dynamic or static, got '{config.cache}'")
        self.config = config
        self.model = None
        self.device = torch.device("cpu")
        self.cache = config.cache
        if config.num_threads:
            torch.set_num_threads(config.num_threads)

    def load(self, model: ModelConfig, path: str, device: torch.device) -> None:
        try:
            import transformers
        except ImportError:
            raise ConfigError("peer=hf needs transformers: pip install -e '.[dev]'") from None
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.device = torch.device(device)
        dtype = DTYPES[model.dtype]
        if model.load_format == "dummy":
            cfg = transformers.AutoConfig.for_model(**{"model_type": "llama", **(model.shape or {})})
            with torch.device(self.device):
                self.model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        else:
            p, kwargs = Path(path), {"dtype": dtype}
            if p.suffix == ".gguf":
                kwargs["gguf_file"] = p.name
                p = p.parent
            self.model = transformers.AutoModelForCausalLM.from_pretrained(str(p), **kwargs).eval().to(self.device)
        if self.cache == "auto":
            self.cache = "static" if self.device.type == "cuda" else "dynamic"

    def warm_up(self, requests, max_num_seqs: int, pad_token_id: int, n: int) -> None:
        """A static cache compiles per shape: warm up on the workload's first full batch (its shapes);
        a dynamic one on `n` short requests."""
        if self.cache == "static":
            self.run(sorted(requests, key=lambda r: r.arrival_s)[:max_num_seqs], max_num_seqs, pad_token_id)
            return
        from dataclasses import replace

        first = requests[0]
        self.run([replace(first, index=i, arrival_s=0.0, prompt_token_ids=[pad_token_id] * 16, output_len=4)
                  for i in range(n)], max_num_seqs, pad_token_id)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in {id(p): p for p in self.model.parameters()}.values())

    def describe(self) -> str:
        kind = "StaticCache, compiled forward" if self.cache == "static" else "DynamicCache"
        return f"transformers {kind} (padded static batches)"

    def _batch(self, batch, pad_token_id: int) -> tuple[list[float], float, int]:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids):] = 1
        new = max(r.output_len for r in batch)
        clock = _StepClock()
        extra = {"cache_implementation": "static"} if self.cache == "static" else {}
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=new,
                                min_new_tokens=new, do_sample=False, pad_token_id=pad_token_id, streamer=clock, **extra)
        return clock.times, t0, int(mask.sum())

    def run(self, requests, max_num_seqs: int, pad_token_id: int, progress=None) -> tuple[list[dict], list[dict]]:
        """Serve `requests` (RequestSpec, arrival-ordered) in static batches of up to max_num_seqs.

        Each request's output length is forced (min = max new tokens = the batch's longest); a
        request's tokens beyond its own length are the static batch's waste, and its finish
        time is when its own last token appeared.
        """
        start = time.perf_counter()
        pending = sorted(requests, key=lambda r: r.arrival_s)
        records, steps = [], []
        while pending:
            now = time.perf_counter() - start
            if pending[0].arrival_s > now:
                time.sleep(pending[0].arrival_s - now)
                now = time.perf_counter() - start
            batch = [r for r in pending if r.arrival_s <= now][:max_num_seqs]
            pending = [r for r in pending if r not in batch]
            times, t0, prompt_tokens = self._batch(batch, pad_token_id)
            for r in batch:
                mine = times[: r.output_len]
                records.append(make_record(
                    str(r.index), arrival=start + r.arrival_s, token_times=mine, num_prompt_tokens=len(r.prompt_token_ids),
                    first_scheduled=t0, prefill_done=mine[0], origin=start, finish_reason="length").to_dict())
            prev = t0
            for k, t in enumerate(times):
                steps.append({"time_s": t - start, "duration_s": t - prev, "num_running": len(batch),
                              "num_waiting": sum(1 for r in pending if r.arrival_s <= t - start),
                              "num_prefill_tokens": prompt_tokens if k == 0 else 0,
                              "num_decode_tokens": 0 if k == 0 else len(batch), "kv_usage": None,
                              "num_seqs": len(batch), "num_sampled": len(batch)})
                prev = t
            if progress is not None:
                progress.update(len(batch))
        return records, steps


@hookimpl
def servelab_peers():
    return {"hf": HFPeer}

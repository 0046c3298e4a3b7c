"""Backend `hf`: the peer baseline, Hugging Face transformers `generate` with static batches.

This is "reuse the training stack": padded static batches, no KV management of our own. It is a
peer, not an engine backend: `run` and `compare` hand it the whole workload and it reports the
same per-request records servelab's engine does, so it appears as just another row.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from core.config import BackendConfig
from core.errors import ConfigError
from core.plugins import hookimpl
from core.types import KVCacheSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
    is_peer = True

    def __init__(self, config: BackendConfig, model=None, spec: KVCacheSpec | None = None) -> None:
        self.config = config

    @staticmethod
    def load(path: str, dtype: str):
        try:
            import transformers
        except ImportError:
            raise ConfigError("backend=hf needs transformers: pip install -e '.[dev]'") from None
        p = Path(path)
        kwargs = {"dtype": DTYPES[dtype]}
        if p.suffix == ".gguf":
            kwargs["gguf_file"] = p.name
            p = p.parent
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        return transformers.AutoModelForCausalLM.from_pretrained(str(p), **kwargs).eval()

    def run(self, model, requests, max_num_seqs: int, pad_token_id: int, progress=None) -> tuple[list[dict], list[dict]]:
        """Serve `requests` (RequestSpec, arrival-ordered) in static batches of up to max_num_seqs.

        Each request's output length is forced (min = max new tokens = the batch's longest);
        a request's tokens beyond its own length are the static batch's waste, and its
        finish time is when its own last token appeared.
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
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):  # left padding, as decoder-only generation needs
                ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[i, width - len(r.prompt_token_ids):] = 1
            new = max(r.output_len for r in batch)
            clock = _StepClock()
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, pad_token_id=pad_token_id, streamer=clock)
            for r in batch:
                times = clock.times[: r.output_len]
                arrival = start + r.arrival_s
                ttft, e2e = times[0] - arrival, times[-1] - arrival
                records.append({
                    "request_id": str(r.index), "index": 0, "num_prompt_tokens": len(r.prompt_token_ids),
                    "num_output_tokens": r.output_len, "queue_s": t0 - arrival, "prefill_s": times[0] - t0,
                    "ttft_s": ttft, "tpot_s": (e2e - ttft) / (r.output_len - 1) if r.output_len > 1 else None,
                    "e2e_s": e2e, "itl_s": [b - a for a, b in zip(times, times[1:])], "num_preemptions": 0,
                    "num_cached_tokens": 0, "finish_reason": "length", "arrival_s": r.arrival_s,
                    "finish_s": times[-1] - start, "token_times_s": [t - start for t in times],
                })
            prev = t0
            for k, t in enumerate(clock.times):
                steps.append({"time_s": t - start, "duration_s": t - prev, "num_running": len(batch),
                              "num_waiting": sum(1 for r in pending if r.arrival_s <= t - start),
                              "num_prefill_tokens": int(mask.sum()) if k == 0 else 0,
                              "num_decode_tokens": 0 if k == 0 else len(batch), "kv_usage": None,
                              "num_seqs": len(batch), "num_sampled": len(batch)})
                prev = t
            if progress is not None:
                progress.update(len(batch))
        return records, steps


@hookimpl
def servelab_backends():
    return {"hf": HFPeer}

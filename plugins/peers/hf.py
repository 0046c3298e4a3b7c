"""Peer `hf`: Hugging Face transformers `generate` with static batches.

This is "reuse the training stack": padded static batches, no KV management of our own. It is a
peer, not part of the engine: `run` and `compare` hand it the whole workload and it writes the
same per-request records and step stats servelab's engine does, so it is just another row.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from core.api import DTYPES, ConfigError, PeerConfig, hookimpl, make_record


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
    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        self.model = None
        if config.num_threads:
            torch.set_num_threads(config.num_threads)

    def load(self, model_path: str, dtype: str) -> None:
        try:
            import transformers
        except ImportError:
            raise ConfigError("peer=hf needs transformers: pip install -e '.[dev]'") from None
        p = Path(model_path)
        kwargs = {"dtype": DTYPES[dtype]}
        if p.suffix == ".gguf":
            kwargs["gguf_file"] = p.name
            p = p.parent
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(p), **kwargs).eval()

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in {id(p): p for p in self.model.parameters()}.values())

    def describe(self) -> str:
        return "transformers DynamicCache (padded static batches)"

    def _batch(self, batch, pad_token_id: int) -> tuple[list[float], float, int]:
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
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                do_sample=False, pad_token_id=pad_token_id, streamer=clock)
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

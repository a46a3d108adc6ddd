"""Batched generation by the target, cached on disk and resumable.

:func:`generate_batch` runs one left-padded batch through the target with a
KV cache and keeps, per sequence, the target's final hidden state at every
position that predicted a generated token, so drafters that read hidden states
(Medusa heads) never rerun the target. :class:`GenerationStore` appends each
finished batch to a folder (``part_<time>_<pid>.json`` with the token ids,
written last, and ``part_<time>_<pid>.safetensors`` with the hidden states;
names unique per writer, so several runs may share the folder); an
interrupted run reloads the finished parts and generates only what is missing.

In a multi-process run (``accelerate launch``, ``torchrun``) :func:`generate_all`
splits the batches across the processes, each writing its own parts to the shared
folder, and every process then reads all of them: the folder is the same cache a
single-process run writes and reads, batch for batch.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import DynamicCache

from specdec.decoders.engine.sampling import SamplingConfig, processed_probs, sample
from specdec.decoders.models.architecture import decoder_of
from specdec.train.processes import process_state


@dataclass(frozen=True)
class Request:
    """A prompt to generate from; ``id`` names it in the cache (e.g. ``magpie/12``)."""

    id: str
    prompt: tuple[int, ...]


@dataclass
class Generation:
    """What the target generated after a prompt.

    hidden: (len(output), hidden) float16 or None; row j is the target's final
    hidden state at the position whose next-token prediction was output[j].
    """

    prompt: list[int]
    output: list[int]
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int
    sampling: SamplingConfig  # temperature 0 = greedy
    batch_size: int
    keep_hidden: bool


@torch.inference_mode()
def generate_batch(
    model: torch.nn.Module,
    prompts: list[tuple[int, ...]],
    settings: GenerationSettings,
    eos_token_ids: frozenset[int],
    pad_token_id: int,
    generator: torch.Generator,
) -> list[Generation]:
    """Generate after each prompt (left padding, one KV cache for the batch).

    Each output ends at its first EOS (kept) or after ``max_new_tokens``. Finished
    sequences leave the batch (and the cache) at once, so a batch costs what its
    unfinished sequences need, not what its longest one needs for all.
    """
    device = next(model.parameters()).device
    decoder, lm_head = decoder_of(model), model.get_output_embeddings()
    count, width = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((count, width), pad_token_id, dtype=torch.long)  # (B, width)
    attention_mask = torch.zeros((count, width), dtype=torch.long)  # (B, width)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (active, width)
    eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    rows = torch.arange(count, device=device)  # (active,) batch row of each unfinished sequence
    tokens = torch.full((count, settings.max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    hidden_size = lm_head.in_features
    hiddens = torch.zeros((count, settings.max_new_tokens, hidden_size) if settings.keep_hidden else (0,),
                          dtype=torch.float16, device=device)  # fmt: skip
    lengths = torch.zeros(count, dtype=torch.long)  # (B,)
    step_input = input_ids
    for step in range(settings.max_new_tokens):
        outputs = decoder(
            input_ids=step_input,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
        )
        hidden = outputs.last_hidden_state[:, -1]  # (active, hidden)
        # With model.device_map the head may sit on another device than the embeddings
        # (``device``, where the batch lives); the moves cost nothing on a single device.
        logits = lm_head(hidden).float().to(device)  # (active, vocab)
        if settings.sampling.greedy:
            next_tokens = logits.argmax(-1)  # (active,)
        else:
            next_tokens = sample(processed_probs(logits, settings.sampling), generator)  # (active,)
        tokens[rows, step] = next_tokens
        if settings.keep_hidden:
            hiddens[rows, step] = hidden.to(device, torch.float16)
        lengths[rows.cpu()] += 1
        unfinished = ~torch.isin(next_tokens, eos)  # (active,)
        if not bool(unfinished.any()):
            break
        if not bool(unfinished.all()):  # drop finished sequences from the batch and the cache
            keep = unfinished.nonzero().flatten()
            cache.batch_select_indices(keep)
            rows, next_tokens = rows[keep], next_tokens[keep]
            attention_mask, position_ids = attention_mask[keep], position_ids[keep]
        step_input = next_tokens[:, None]  # (active, 1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        position_ids = position_ids[:, -1:] + 1

    tokens, hiddens = tokens.cpu(), hiddens.cpu()
    return [
        Generation(
            list(prompt),
            tokens[row, : lengths[row]].tolist(),
            hiddens[row, : lengths[row]].clone() if settings.keep_hidden else None,
        )
        for row, prompt in enumerate(prompts)
    ]


class GenerationStore:
    """A folder of finished generations, appended one batch (part) at a time."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.generations: dict[str, Generation] = {}
        self._loaded: set[str] = set()
        self.refresh()

    @property
    def parts(self) -> int:
        return len(self._loaded)

    def refresh(self) -> None:
        """Read the parts that other writers (processes) added since the last look."""
        for index_file in sorted(self.directory.glob("part_*.json")):
            if index_file.name not in self._loaded:
                self._load_part(index_file)
                self._loaded.add(index_file.name)

    def _load_part(self, index_file: Path) -> None:
        items = json.loads(index_file.read_text())
        tensor_file = index_file.with_suffix(".safetensors")
        hidden = load_file(str(tensor_file)) if tensor_file.exists() else {}
        for item in items:
            self.generations[item["id"]] = Generation(item["prompt"], item["output"], hidden.get(item["id"]))

    def get(self, request: Request, with_hidden: bool = False) -> Generation | None:
        """The cached generation for ``request``, if its prompt is the same (and it has
        its hidden states, if ``with_hidden``)."""
        found = self.generations.get(request.id)
        if found is None or tuple(found.prompt) != request.prompt:
            return None
        if with_hidden and (found.hidden is None or len(found.hidden) != len(found.output)):
            return None
        return found

    def add(self, ids: list[str], generations: list[Generation]) -> None:
        """Write one part atomically: tensors first, then the index that makes the part visible."""
        self.directory.mkdir(parents=True, exist_ok=True)
        stem = self.directory / f"part_{time.time_ns()}_{os.getpid()}"
        hidden = {i: g.hidden.contiguous() for i, g in zip(ids, generations) if g.hidden is not None}
        if hidden:
            _atomic_write(stem.with_suffix(".safetensors"), lambda path: save_file(hidden, str(path)))
        items = [{"id": i, "prompt": g.prompt, "output": g.output} for i, g in zip(ids, generations)]
        index_file = stem.with_suffix(".json")
        _atomic_write(index_file, lambda path: path.write_text(json.dumps(items)))
        self.generations.update(zip(ids, generations))
        self._loaded.add(index_file.name)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


@contextlib.contextmanager
def _interrupt_says_what_is_kept(store: GenerationStore, done, total: int, main: bool):
    """Ctrl-C while generating the training data: say what is kept (every finished batch is in
    the store) and that the same command continues from it."""
    try:
        yield
    except KeyboardInterrupt:
        if main:
            print(
                f"\n[train] interrupted while generating training data: the {done()} of {total} sequences "
                f"finished are kept in {store.directory}; run the same command again to continue",
                file=sys.stderr,
            )
        raise


def generate_all(
    model: torch.nn.Module,
    requests: list[Request],
    store: GenerationStore,
    settings: GenerationSettings,
    eos_token_ids: frozenset[int],
    pad_token_id: int,
    desc: str,
) -> dict[str, Generation]:
    """Generations for every request: cached ones reused, the rest generated in
    batches of similar prompt length (less padding) and stored as they finish.

    Every process of a run calls this with the same requests; each generates its share
    of the batches (the batches a single process would form, so outputs do not depend on
    the number of processes) and returns all of them. Progress shows the main process's share."""
    state = process_state()
    if state.num_processes > 1:  # every process must see the same parts: none writes before all have looked
        store.refresh()
        state.wait_for_everyone()
    pending = [r for r in requests if store.get(r, settings.keep_hidden) is None]
    if pending:
        pending.sort(key=lambda r: len(r.prompt))
        batches = [pending[i : i + settings.batch_size] for i in range(0, len(pending), settings.batch_size)]
        first_part = store.parts
        with state.split_between_processes(list(enumerate(batches))) as mine:
            mine_count = sum(len(batch) for _, batch in mine)
            new_tokens, start = 0, time.perf_counter()
            with (
                tqdm(total=mine_count, desc=desc, unit="seq", disable=not state.is_main_process) as progress,
                _interrupt_says_what_is_kept(store, lambda: progress.n, mine_count, state.is_main_process),
            ):
                for index, batch in mine:
                    # Seeded per part, so sampled stages reproduce however often they are resumed
                    # and however many processes share the work.
                    generator = torch.Generator(device=next(model.parameters()).device)
                    generator.manual_seed(settings.sampling.seed * 1_000_003 + first_part + index)
                    generations = generate_batch(
                        model, [r.prompt for r in batch], settings, eos_token_ids, pad_token_id, generator
                    )
                    store.add([r.id for r in batch], generations)
                    new_tokens += sum(len(g.output) for g in generations)
                    progress.update(len(batch))
                    progress.set_postfix(tokens_per_s=f"{new_tokens / (time.perf_counter() - start):.0f}")
        state.wait_for_everyone()
        store.refresh()
    return {r.id: store.get(r) for r in requests}  # type: ignore[misc]

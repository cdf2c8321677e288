"""The LocCa decoder of SigLIP 2's recipe: captioning, referring expressions and grounded captioning from the image
tower's un-pooled tokens.

Owns the decoder (open_clip's `MultimodalTransformer` blocks, with per-example causal or parallel masks) and its
per-example loss: a sum over each example's target tokens (`DecoderOutput.token_loss_sum`), which the window
normalises by the whole window's target tokens; and its evaluation on the validation split (`decoder_metrics`).
docs/siglip2_recipe.md; the objective: docs/accumulation.md.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from open_clip.transformer import MultimodalTransformer
from torch import nn

from naflexclip.batch import EXAMPLE_INPUTS, to_device
from naflexclip.data.build import build_loader
from naflexclip.data.data_config import DataConfig
from naflexclip.data.regions import CaptionTokens, DecoderExamples
from naflexclip.families import data_processing
from naflexclip.processing.decoder_tokens import (  # the token language the data pipeline writes
    IGNORE,
    TASKS,
    DecoderBatch,
    Vocabulary,
    collate_decoder,
    decoder_example,
)
from naflexclip.window import Term

LOCCA = "locca"  # the term's name (logged as loss/locca)
DECODER_EVAL_SAMPLES = 64  # validation samples per decoder task (greedy decoding is a forward per token)
HEAD_SLOT = "decoder"  # where the model holds the decoder (`NaFlexClip.attach_head`)


@dataclass(frozen=True)
class DecoderConfig:
    """The decoder's size; the text vocabulary is the text tower's, `box_bins` coordinate tokens are added after it."""

    width: int = 512
    layers: int = 6
    heads: int = 8
    max_length: int = 80  # task token + prefix + target, longest
    box_bins: int = 1000  # quantisation of each box coordinate in [0, 1] (Pix2Seq's 1000 bins: Chen et al. 2022)


# decoder size per model preset (our choice: SigLIP 2 does not restate LocCa's decoder size; a decoder narrower and
# shallower than the text tower keeps its cost a fraction of the towers')
DECODER_SIZES: dict[str, DecoderConfig] = {
    "tiny": DecoderConfig(width=32, layers=1, heads=2, max_length=48),
    "small": DecoderConfig(width=128, layers=2, heads=4, max_length=64),
    "base": DecoderConfig(width=512, layers=6, heads=8),
    "siglip2-base": DecoderConfig(width=768, layers=6, heads=12),
    "siglip2-so400m": DecoderConfig(width=1152, layers=6, heads=16),
}


@dataclass(frozen=True)
class DecoderOutput:
    logits: torch.Tensor  # [B, T, output_size], T up to the batch's longest example (trailing padding dropped)
    token_loss_sum: torch.Tensor  # [B]: each example's cross-entropy summed over its target tokens
    target_tokens: torch.Tensor  # [B]: each example's target tokens


class LoccaDecoder(nn.Module):
    """Transformer decoder over the image tower's tokens (open_clip's CoCa decoder blocks)."""

    def __init__(self, config: DecoderConfig, *, image_width: int, text_vocab: int) -> None:
        super().__init__()
        self.config = config
        self.vocab = Vocabulary(text_vocab=text_vocab, box_bins=config.box_bins)
        self.token_embedding = nn.Embedding(self.vocab.input_size, config.width)
        self.positional_embedding = nn.Parameter(torch.randn(config.max_length, config.width) * 0.01)
        self.image_projection = nn.Linear(image_width, config.width)
        self.transformer = MultimodalTransformer(width=config.width, layers=config.layers, heads=config.heads,
                                                 context_length=config.max_length, output_dim=self.vocab.output_size)
        nn.init.normal_(self.transformer.text_projection, std=config.width ** -0.5)

    def sharding_units(self) -> list[nn.Module]:
        """The blocks FSDP2 gathers one at a time (`NaFlexClip.sharding_units` lists them after the towers')."""
        return [*self.transformer.resblocks, *self.transformer.cross_attn]

    def _self_mask(self, batch: DecoderBatch) -> torch.Tensor:
        length = batch.input_ids.shape[1]
        device = batch.input_ids.device
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        allowed = torch.where(batch.parallel[:, None, None], torch.ones_like(causal), causal)
        allowed = allowed & (batch.input_ids != self.vocab.pad)[:, None, :]
        allowed = allowed | torch.eye(length, dtype=torch.bool, device=device)  # a padded query sees itself
        return allowed

    def _additive(self, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`[B, Q, K]` booleans → the `[B·heads, Q, K]` additive mask `nn.MultiheadAttention` takes."""
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask = mask.masked_fill(~allowed, float("-inf"))
        return mask.repeat_interleave(self.config.heads, dim=0)

    def forward(self, image_tokens: torch.Tensor, image_valid: torch.Tensor, batch: DecoderBatch) -> DecoderOutput:
        """image_tokens `[B, L, image_width]`: every token of the tower (prefix tokens too); image_valid `[B, L]`.
        The logits cover the batch's columns up to its longest example (`DecoderOutput.logits`)."""
        states, batch = self._states(image_tokens, image_valid, batch)
        logits = states @ self.transformer.text_projection
        # the loss in at least float32 under bf16/fp16 autocast; float64 (verify) stays float64
        wide = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        per_token = F.cross_entropy(wide.transpose(1, 2), batch.labels, ignore_index=IGNORE, reduction="none")
        return DecoderOutput(logits=logits, token_loss_sum=per_token.sum(dim=1),
                             target_tokens=(batch.labels != IGNORE).sum(dim=1))

    def _states(self, image_tokens: torch.Tensor, image_valid: torch.Tensor, batch: DecoderBatch
                ) -> tuple[torch.Tensor, DecoderBatch]:
        """The final normalised states `[B, T, width]` before the vocabulary projection, and the batch cut to the
        columns they cover."""
        length = batch.input_ids.shape[1]
        if length > self.config.max_length:
            raise ValueError(f"decoder input of {length} tokens exceeds max_length {self.config.max_length}")
        # columns that are padding in every row (examples are collated to max_length so that microbatches concatenate)
        # are keys every query is masked from and queries without a label: dropped, the result is the same and the
        # vocabulary projection, the decoder's largest cost, runs on the used columns only
        used = ((batch.input_ids != self.vocab.pad) | (batch.labels != IGNORE)).any(dim=0).nonzero()
        length = int(used.max()) + 1 if len(used) else 1
        if length < batch.input_ids.shape[1]:
            batch = DecoderBatch(batch.input_ids[:, :length], batch.labels[:, :length], batch.parallel)
        x = self.token_embedding(batch.input_ids) + self.positional_embedding[:length]
        memory = self.image_projection(image_tokens).to(x.dtype)
        self_mask = self._additive(self._self_mask(batch), x.dtype)
        cross_mask = self._additive(image_valid.bool()[:, None, :].expand(-1, length, -1), x.dtype)
        blocks = self.transformer
        for block, cross in zip(blocks.resblocks, blocks.cross_attn, strict=True):
            x = block(x, attn_mask=self_mask)
            x = cross(x, k_x=memory, v_x=memory, attn_mask=cross_mask)
        return blocks.ln_final(x), batch

    @torch.no_grad()
    def generate(self, image_tokens: torch.Tensor, image_valid: torch.Tensor, task: str, prefixes: list[list[int]],
                 max_new_tokens: int, stop_token: int | None = None) -> list[list[int]]:
        """Greedy autoregressive decoding of `task` with each example's `prefix` (for BLEU and grounding evals)."""
        vocab = self.vocab
        rows = [[vocab.task(task), *prefix, vocab.start] for prefix in prefixes]
        outputs: list[list[int]] = [[] for _ in rows]
        done = [False] * len(rows)
        for _ in range(max_new_tokens):
            ids = [row + out for row, out in zip(rows, outputs, strict=True)]
            length = max(len(i) for i in ids)
            if length > self.config.max_length:
                break
            input_ids = torch.full((len(ids), length), vocab.pad, dtype=torch.long, device=image_tokens.device)
            for r, seq in enumerate(ids):
                input_ids[r, : len(seq)] = torch.tensor(seq, device=image_tokens.device)
            labels = torch.full_like(input_ids, IGNORE)
            parallel = torch.zeros(len(ids), dtype=torch.bool, device=image_tokens.device)
            states, _ = self._states(image_tokens, image_valid, DecoderBatch(input_ids, labels, parallel))
            last = torch.tensor([len(seq) - 1 for seq in ids], device=states.device)
            # only each row's last position is projected onto the vocabulary (what the next token is read from)
            logits = states[torch.arange(len(ids), device=states.device), last] @ self.transformer.text_projection
            for r in range(len(ids)):
                if done[r]:
                    continue
                token = int(logits[r].argmax())
                outputs[r].append(token)
                done[r] = stop_token is not None and token == stop_token
            if all(done):
                break
        return outputs


def random_decoder_inputs(num_examples: int, vocab: Vocabulary, max_length: int,
                          generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Random decoder examples of every task and both modes, as a microbatch's `example_inputs` (for `verify` and
    tests): `decoder_input_ids`, `decoder_labels`, `decoder_parallel`, padded to `max_length`."""
    gen = generator or torch.Generator().manual_seed(0)

    def draw(high: int, low: int = 0) -> int:
        return int(torch.randint(low, high, (1,), generator=gen))

    examples = []
    for _ in range(num_examples):
        task = TASKS[draw(len(TASKS))]
        words = [draw(vocab.text_vocab) for _ in range(draw(max_length // 3, 1))]
        box = vocab.box_tokens(torch.rand(4, generator=gen, dtype=torch.float64).tolist())
        prefix, target = {"caption": ([], words), "aref": (words, box), "gcap": (box, words)}[task]
        parallel = bool(draw(2))
        examples.append((*decoder_example(vocab, task, prefix, target, parallel, max_length), parallel))
    batch = collate_decoder(examples, vocab, length=max_length)
    return {"decoder_input_ids": batch.input_ids, "decoder_labels": batch.labels, "decoder_parallel": batch.parallel}


def target_tokens(microbatch: dict) -> int:
    """A microbatch's decoder target tokens: its share of the decoder term's normaliser Z(W)."""
    return int((microbatch[EXAMPLE_INPUTS]["decoder_labels"] != IGNORE).sum())


def attach_decoder(model: nn.Module, config: DecoderConfig | Mapping[str, Any]) -> LoccaDecoder:
    """The model's LocCa decoder, attached as its child `decoder` (`NaFlexClip.attach_head`) with the weights a
    loaded checkpoint held for it, if any; `config` as the model's config records it (or its saved dict)."""
    config = DecoderConfig(**config) if isinstance(config, Mapping) else config
    decoder = LoccaDecoder(config, image_width=model.config.image.width, text_vocab=model.config.text.vocab_size)
    return model.attach_head(HEAD_SLOT, decoder, config)


class LoccaTerm(Term):
    """The decoder's term `λ · (1/T(W)) · Σ_{i∈W} Σ_{t∈targets(i)} CE_i,t`: each example's cross-entropy summed over
    its target tokens, from the image tower's un-pooled tokens of the grad forward; `T(W)` the window's target
    tokens. The decoder is the model's child `decoder` (`attach_decoder`)."""

    parts = (LOCCA,)
    output_tokens = True

    def __init__(self, weight: float) -> None:
        self.weights = {LOCCA: weight}

    def count(self, microbatch: dict[str, Any]) -> dict[str, float]:
        return {LOCCA: target_tokens(microbatch)}

    def example_losses(self, model: nn.Module, microbatch: dict[str, Any], out: dict[str, Any],
                       constants: dict[str, Any]) -> dict[str, torch.Tensor]:
        decoder = getattr(model, "module", model).decoder
        if decoder is None:
            raise ValueError("the LocCa term needs the model's decoder (attach_decoder, or Recipe.prepare)")
        inputs = microbatch[EXAMPLE_INPUTS]
        batch = DecoderBatch(inputs["decoder_input_ids"], inputs["decoder_labels"], inputs["decoder_parallel"])
        return {LOCCA: decoder(out["image_tokens"], out["image_tokens_valid"], batch).token_loss_sum}

    def random_inputs(self, model: nn.Module, num_examples: int, seed: int) -> dict[str, torch.Tensor]:
        """Every task, causal and parallel, at the decoder's full width."""
        decoder = getattr(model, "module", model).decoder
        return random_decoder_inputs(num_examples, decoder.vocab, decoder.config.max_length,
                                     torch.Generator().manual_seed(seed + 1))


def box_iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """Intersection over union of two `(x0, y0, x1, y1)` boxes (a degenerate union: 0)."""
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
    return w * h / union if union > 0 else 0.0


def decoder_metrics(model: nn.Module, data: DataConfig, device: torch.device,
                    autocast: Callable[[], ContextManager[Any]], skip_records: list[dict[str, Any]],
                    limit: int = DECODER_EVAL_SAMPLES, bleu: bool = True) -> dict[str, float]:
    """The LocCa decoder on the first `limit` samples of the validation split, greedy (`LoccaDecoder.generate`):
    `decoder/caption_bleu4`, BLEU-4 (pycocoevalcap's) of the generated caption against the sample's caption, over
    the text tower's tokens; and
    `decoder/aref_acc` (with `decoder/aref_num` examples), the fraction of regions whose box generated from their
    caption has IoU >= 0.5 with the true box (samples with regions only). A caption is generated up to 2 tokens past
    its batch's longest reference (greedy decoding re-runs the decoder per token). `bleu=False` (pycocoevalcap not
    installed): no captions are generated, no `decoder/caption_bleu4`."""
    decoder = model.decoder
    processing = data_processing(data.hf_processor, model.image_patch_size, **data.image_overrides())
    tokens = CaptionTokens(processing.tokenize, model.context_length)
    generated: dict[int, list[str]] = {}
    references: dict[int, list[str]] = {}
    hits, boxes = 0, 0
    for task in ("caption", "aref") if bleu else ("aref",):
        seen = 0
        examples = DecoderExamples(decoder.vocab, decoder.config.max_length, tokens, task=task)
        with build_loader(data, split="val", patch_size=model.image_patch_size, context_length=model.context_length,
                          processing=processing, inputs=[examples]) as val:
            for batch in val:
                if seen >= limit:
                    break
                batch = to_device(batch, device)
                with autocast():
                    _, image_tokens, valid = model.encode_image_tokens(batch["image"])
                ids, labels = batch[EXAMPLE_INPUTS]["decoder_input_ids"], batch[EXAMPLE_INPUTS]["decoder_labels"]
                rows, prefixes, targets = [], [], []
                for row in range(min(ids.shape[0], limit - seen)):
                    seen += 1
                    if int(ids[row, 0]) != decoder.vocab.task(task):
                        continue  # a sample without regions (aref falls back to its caption)
                    first = int((labels[row] != IGNORE).nonzero()[0])  # the start token's position
                    rows.append(row)
                    prefixes.append(ids[row, 1:first].tolist())
                    targets.append([t for t in labels[row].tolist() if t != IGNORE])
                if not rows:
                    continue
                with autocast():
                    outputs = decoder.generate(image_tokens[rows], valid[rows], task, prefixes,
                                               max_new_tokens=4 if task == "aref" else 2 + max(map(len, targets)),
                                               stop_token=tokens.end)
                for output, target in zip(outputs, targets, strict=True):
                    if task == "aref":
                        box, true_box = decoder.vocab.box_of(output), decoder.vocab.box_of(target)
                        hits += int(box is not None and true_box is not None and box_iou(box, true_box) >= 0.5)
                        boxes += 1
                    else:
                        words = [str(t) for t in output if t != tokens.end]
                        key = len(generated)
                        generated[key] = [" ".join(words) or "<empty>"]
                        references[key] = [" ".join(str(t) for t in target if t != tokens.end)]
        skip_records.extend(val.skip_records)
    metrics: dict[str, float] = {}
    if generated:
        from pycocoevalcap.bleu.bleu import Bleu

        with contextlib.redirect_stdout(io.StringIO()):  # pycocoevalcap prints its counts
            scores, _ = Bleu(4).compute_score(references, generated)
        metrics["decoder/caption_bleu4"] = float(scores[3])
    if boxes:
        metrics["decoder/aref_acc"] = hits / boxes
        metrics["decoder/aref_num"] = float(boxes)
    return metrics

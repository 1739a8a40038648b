"""Central pretraining of the tiny seed speech-LLM on the public split.

The paper fine-tunes pretrained Whisper and LLM checkpoints; the embedded default has no such
checkpoints, so the tiny random model is first trained centrally (all weights, AdamW, linear
warm-up then cosine decay) on the public speakers, saved with ``SpeechLLM.save_pretrained`` and
reloaded as the federated starting point. A plain loop rather than ``sb.Brain.fit`` because it is
a one-off step over an arbitrary iterable of batches, run before the recipe's Brain exists.
:func:`pretrain_text_lm` trains the LLM alone on text (the stand-in for a pretrained LLM such as
TinyLlama); with ``ctc_warmup_steps == steps``, :func:`pretrain_seed_model` trains the encoder
alone as a CTC acoustic model (the stand-in for Whisper).
:func:`train_steps` is the same loop for any other seed model (a loss function per batch).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from speechbrain_fl.models.speech_llm import SpeechLLM, SpeechLLMOutput, causal_lm_loss

logger = logging.getLogger(__name__)


def pretrain_seed_model(
    model: SpeechLLM,
    batches: Iterable,
    *,
    steps: int,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    warmup_steps: int = 0,
    max_grad_norm: float = 1.0,
    train_base: bool = True,
    log_every: int = 10,
    ctc_warmup_steps: int = 0,
    grad_accumulation_factor: int = 1,
    precision: str = "fp32",
    progressbar: bool = False,
) -> dict[str, list[float] | float]:
    """Train ``model`` for ``steps`` optimiser steps, cycling over ``batches``.

    Arguments
    ---------
    model : SpeechLLM
        Built with ``lora_r=0`` when ``train_base`` (adapters would be trained and then not
        saved by ``save_pretrained``).
    batches : Iterable
        Re-iterable of ``(wavs, wav_lens, transcripts)`` or ``(wavs, wav_lens, transcripts,
        languages)`` (the latter for a prompt naming ``{language}``); restarted when exhausted.
    steps : int
        Number of optimiser steps.
    lr, weight_decay : float
        AdamW settings; the rate follows ``get_cosine_schedule_with_warmup``.
    warmup_steps : int
        Linear warm-up steps.
    max_grad_norm : float
        Gradient-norm clipping (``torch.nn.utils.clip_grad_norm_``); <= 0 disables it.
    train_base : bool
        Train every weight (True) or only the currently trainable ones (False).
    log_every : int
        Log the running loss every this many steps.
    ctc_warmup_steps : int
        First steps train the encoder with the CTC auxiliary loss alone (needs a CTC head).
        A decoder trained from scratch next to a random encoder learns to predict transcripts
        from its own prefix (a language model) long before it learns to read the audio tokens;
        giving the encoder a head start on the alignment first makes the audio tokens
        informative when the decoder starts (a curriculum, as in CTC-attention hybrids).
    grad_accumulation_factor : int
        Batches whose gradients are summed (each loss divided by the factor) per optimiser
        step, as SpeechBrain's ``--grad_accumulation_factor``.
    precision : str
        ``fp32``, ``bf16`` or ``fp16`` autocast of the forward pass (SpeechBrain's
        ``--precision``; ``fp16`` with a gradient scaler).
    progressbar : bool
        Show a tqdm bar over the steps.

    Returns
    -------
    dict
        ``loss``/``ce``/``ctc`` per step and ``seconds`` spent.

    Example
    -------
    >>> import tempfile
    >>> from speechbrain_fl.models.presets import build_speech_llm
    >>> model = build_speech_llm("tiny", cache_dir=tempfile.mkdtemp(), lora_r=0, seed=0)
    >>> batch = (torch.randn(1, 16000), torch.ones(1), ["hi"])
    >>> len(pretrain_seed_model(model, [batch], steps=2)["loss"])
    2
    """
    _check_arguments(
        model,
        steps=steps,
        grad_accumulation_factor=grad_accumulation_factor,
        precision=precision,
        ctc_warmup_steps=ctc_warmup_steps,
        train_base=train_base,
    )
    if train_base:
        model.set_trainable(train_encoder_lora=False, train_base=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup_steps, steps)
    device = next(model.connector.parameters()).device
    history: dict[str, list[float]] = {"loss": [], "ce": [], "ctc": []}
    start = time.perf_counter()
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    model.train()
    next_batch = _cycling(batches)
    autocast_dtype = _AUTOCAST_DTYPES[precision] or torch.float32
    for step in tqdm(range(steps), desc="seed pretraining", disable=not progressbar):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(grad_accumulation_factor):
            batch = next_batch()
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=precision != "fp32"):
                out = _batch_loss(model, batch, device=device, ctc_only=step < ctc_warmup_steps)
            scaler.scale(out.loss / grad_accumulation_factor).backward()
        scaler.unscale_(optimizer)
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        _record(history, out)
        if log_every and (step + 1) % log_every == 0:
            logger.info(
                "seed pretraining step %d/%d loss %.4f", step + 1, steps, history["loss"][-1]
            )
    model.eval()
    return {**history, "seconds": time.perf_counter() - start}


#: Autocast dtype of each ``precision`` (``fp32``: autocast off).
_AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check_arguments(
    model: SpeechLLM,
    *,
    steps: int,
    grad_accumulation_factor: int,
    precision: str,
    ctc_warmup_steps: int,
    train_base: bool,
) -> None:
    """``ValueError`` naming the :func:`pretrain_seed_model` argument that cannot work.

    ``steps`` and ``grad_accumulation_factor`` >= 1, a known ``precision``, a CTC head for a
    CTC warm-up, no LoRA adapters when every base weight is to be trained (they would be
    trained and then not saved by ``save_pretrained``).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if grad_accumulation_factor < 1:
        raise ValueError(f"grad_accumulation_factor must be >= 1, got {grad_accumulation_factor}")
    if precision not in _AUTOCAST_DTYPES:
        raise ValueError(f"precision must be one of {sorted(_AUTOCAST_DTYPES)}, got {precision!r}")
    if ctc_warmup_steps > 0 and model.ctc_head is None:
        raise ValueError("ctc_warmup_steps > 0 needs a model built with ctc_weight > 0")
    if train_base and any("lora_" in name for name, _ in model.named_parameters()):
        raise ValueError("pretrain_seed_model(train_base=True) needs a model built with lora_r=0")


def _cycling(batches: Iterable) -> Callable[[], Any]:
    """A function returning the next batch of ``batches``, restarting it when exhausted.

    ``ValueError`` when a fresh iteration yields nothing (an empty iterable, or a one-shot
    iterator already consumed).
    """
    iterator = iter(batches)

    def next_batch():
        nonlocal iterator
        try:
            return next(iterator)
        except StopIteration:
            iterator = iter(batches)
            try:
                return next(iterator)
            except StopIteration:
                raise ValueError("pretrain_seed_model got an empty batch iterable") from None

    return next_batch


def _batch_loss(
    model: SpeechLLM, batch: Sequence, *, device: torch.device, ctc_only: bool
) -> SpeechLLMOutput:
    """The model's losses on ``(wavs, wav_lens, transcripts[, languages])``.

    ``ctc_only`` (the CTC warm-up): the encoder's CTC loss alone on the transcripts' tokens
    without the end token, as ``loss`` and ``ctc_loss`` (``ce_loss`` NaN); else the full
    forward pass (``loss = ce + ctc_weight * ctc``).
    """
    wavs, wav_lens, transcripts = batch[:3]
    languages = list(batch[3]) if len(batch) > 3 else None
    if ctc_only:
        frames, enc_lens, _, _ = model.encode(wavs.to(device), wav_lens.to(device))
        targets = [t[:-1] for t in model.tokenize_transcripts(list(transcripts))]
        ctc = model.ctc_loss(frames, enc_lens, targets)
        return SpeechLLMOutput(
            loss=ctc, ce_loss=torch.full((), float("nan")), ctc_loss=ctc, num_tokens=0
        )
    return model(wavs.to(device), wav_lens.to(device), list(transcripts), languages)


def _record(history: dict[str, list[float]], out: SpeechLLMOutput) -> None:
    """Append a step's ``loss``, ``ce`` and ``ctc`` (NaN without a CTC loss) to ``history``."""
    history["loss"].append(out.loss.item())
    history["ce"].append(out.ce_loss.item())
    history["ctc"].append(out.ctc_loss.item() if out.ctc_loss is not None else float("nan"))


def train_steps(
    model: torch.nn.Module,
    batches: Iterable,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    steps: int,
    max_grad_norm: float,
    desc: str = "seed pretraining",
    progressbar: bool = True,
) -> list[float]:
    """The plain central training loop of a seed model: ``steps`` optimiser steps.

    Each step draws the next batch (``batches`` is restarted when exhausted, so a shuffling
    loader reshuffles), computes ``loss_fn(batch)``, back-propagates, clips the gradient norm of
    ``model.parameters()`` to ``max_grad_norm`` (``torch.nn.utils.clip_grad_norm_``), then steps
    the optimiser and the scheduler. The loop of any seed model that is not a speech-LLM (the
    SUPERB recipe's multi-exit wav2vec 2.0); :func:`pretrain_seed_model` is the speech-LLM's
    (CTC warm-up, precision, gradient accumulation).

    Returns
    -------
    list of float
        The loss of every step.

    Example
    -------
    >>> net = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    >>> data = [torch.ones(4, 2)]
    >>> losses = train_steps(net, data, lambda x: net(x).pow(2).mean(), optimizer=opt,
    ...                      scheduler=sched, steps=3, max_grad_norm=5.0, progressbar=False)
    >>> len(losses), losses[-1] < losses[0]
    (3, True)
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    iterator = None
    losses: list[float] = []
    model.train()
    with tqdm(total=steps, desc=desc, unit="step", disable=not progressbar) as bar:
        for _ in range(steps):
            batch = None
            for _attempt in range(2):  # restart an exhausted iterable once
                if iterator is None:
                    iterator = iter(batches)
                try:
                    batch = next(iterator)
                    break
                except StopIteration:
                    iterator = None
            if batch is None:
                raise ValueError("train_steps got an empty batch iterable")
            loss = loss_fn(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    return losses


def pretrain_text_lm(
    model: SpeechLLM,
    texts: Sequence[tuple[str, str | None]],
    *,
    steps: int,
    lr: float = 1e-3,
    batch_size: int = 32,
    weight_decay: float = 0.01,
    warmup_steps: int = 0,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    log_every: int = 50,
) -> dict[str, list[float] | float]:
    """Train the speech-LLM's LLM alone as a causal LM on text (the stand-in for TinyLlama).

    Each sequence is ``<bos> prompt(language) transcript </s>``, the model's own text layout
    without the audio tokens, and the loss is the causal LM cross-entropy over the transcript
    tokens and the end token (the prompt is context, as in :meth:`SpeechLLM.forward`):
    ``L = -(1/S) sum_s log p(y_s | <bos>, prompt, y_<s)``. Only ``model.llm`` trains (AdamW,
    linear warm-up then cosine decay, gradient-norm clipping); the encoder and the connector are
    left as they are. Batches are drawn with replacement by a generator seeded with ``seed``.

    Arguments
    ---------
    model : SpeechLLM
        Built with ``lora_r=0`` (every LLM weight trains).
    texts : sequence of (str, str or None)
        ``(transcript, language)`` pairs; the language fills the prompt's ``{language}``.
    steps, batch_size : int
        Optimiser steps and sequences per step.
    lr, weight_decay, max_grad_norm : float
        AdamW settings and the clipping bound (<= 0 disables it).
    warmup_steps : int
        Linear warm-up steps.
    seed : int
        Seed of the batch draws.
    log_every : int
        Log the loss every this many steps (0: never).

    Returns
    -------
    dict
        ``loss`` per step and ``seconds`` spent.

    Example
    -------
    >>> import tempfile
    >>> from speechbrain_fl.models.presets import build_speech_llm
    >>> model = build_speech_llm("tiny", cache_dir=tempfile.mkdtemp(), lora_r=0, seed=0)
    >>> out = pretrain_text_lm(model, [("hello", None)] * 4, steps=20, lr=1e-2, batch_size=2)
    >>> out["loss"][-1] < out["loss"][0]
    True
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps} and {batch_size}")
    if not texts:
        raise ValueError("pretrain_text_lm got no texts")
    if any("lora_" in name for name, _ in model.named_parameters()):
        raise ValueError("pretrain_text_lm needs a model built with lora_r=0")
    llm = model.llm
    params = list(llm.parameters())
    for param in params:
        param.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup_steps, steps)
    generator = torch.Generator().manual_seed(seed)
    history: list[float] = []
    start = time.perf_counter()
    llm.train()
    for step in range(steps):
        picks = torch.randint(len(texts), (batch_size,), generator=generator).tolist()
        loss = _text_lm_loss(model, [texts[i] for i in picks])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        scheduler.step()
        history.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            logger.info("text LM pretraining step %d/%d loss %.4f", step + 1, steps, history[-1])
    llm.eval()
    return {"loss": history, "seconds": time.perf_counter() - start}


def _text_lm_loss(model: SpeechLLM, batch: Sequence[tuple[str, str | None]]) -> torch.Tensor:
    """Causal LM cross-entropy of ``<bos> prompt transcript </s>`` rows over the transcripts.

    Rows are right-padded; labels are -100 on the prefix and the padding.
    """
    device = next(model.llm.parameters()).device
    head = [model.bos_id] if model.bos_id is not None else []
    targets = model.tokenize_transcripts([text for text, _ in batch])
    rows, labels = [], []
    for (_, language), target in zip(batch, targets, strict=True):
        prefix = head + model.prompt_ids(language)
        rows.append(prefix + target)
        labels.append([-100] * len(prefix) + target)
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), model.pad_id, dtype=torch.long)
    label_ids = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, label) in enumerate(zip(rows, labels, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        label_ids[i, : len(row)] = torch.tensor(label)
        mask[i, : len(row)] = 1
    logits = model.llm(
        input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False
    ).logits
    return causal_lm_loss(logits, label_ids.to(device))

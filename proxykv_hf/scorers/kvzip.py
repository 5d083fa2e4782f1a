"""KVzip: score each context KV pair by how much the model attends to it while repeating the context
(Kim et al., 2025, arXiv:2505.23416). The oracle ProxyKV is trained against.

After the prefill, the model is teacher-forced to reconstruct its own context, chunk by chunk, from a cache that
holds the full context K/V. For chunk ``i`` (``context_chunk`` real tokens) the repeat input is::

    chunk 0:  "\\n\\nRepeat the previous context exactly." + postfix + chunk_0
    chunk i:  "\\n\\nRepeat the part of the previous context exactly, starting with" + last prev_postfix_size
              tokens of chunk_{i-1} + postfix + chunk_i

where ``postfix`` closes the user turn and opens the assistant turn, taken from the tokenizer's chat template
(``"\\n"`` without one). The score of a context key is the **max over the repeat queries and over the query heads of
its GQA group** of the softmax attention it receives, the softmax being taken over a subsampled key set only::

    [first min(n_sink, chunk start) real tokens] + [keys of chunk i] + [repeat keys, causal]

The first ``n_sink`` real tokens get score 1.0 and are always kept. Scores are `(B, H_kv, T)`, in [0, 1], 0 on
padding.

Differences from kvpress's ``KVzipPress`` (and the reference, which kvpress follows):

* the whole prompt is chunked from its first real token; kvpress skips the chat-template prefix (its tokens past
  ``n_sink`` keep score 0). Our prompt may or may not start with a template, so every real token is scored. The
  sink keys are kvpress's first ``n_sink`` tokens (the reference uses its whole system prompt);
* softmax in float32 (``dtype`` changes it); kvpress and the reference use the model dtype (bf16). On a GPU with
  Triton the float32 softmax of every chunk whose columns are all real runs in the fused kernels of
  :mod:`proxykv_hf.attention.kernels` (the model's own q and k in the tensor cores, float32 accumulation), never writing
  the probabilities;
* the softmax scale is the layer's own ``scaling`` (``1/sqrt(D)`` except Gemma3's ``query_pre_attn_scalar``);
  kvpress always uses ``1/sqrt(D)``;
* batches: chunk boundaries are computed per row on its real tokens; the rows' repeat inputs are padded on the
  right, so every real repeat token sits at the same index and position as in a run of its row alone (this also
  keeps sliding-window layers exact). kvpress supports batch size 1 only;
* ``prev_postfix_size=0`` carries nothing over (kvpress's ``[-0:]`` slice would carry the whole chunk);
* repeat positions continue after each row's *real* length (``generate``'s convention, ``position_ids =
  cumsum(mask) - 1``; a padded batch run by a plain ``model(...)`` call without ``position_ids`` was prefilled
  at ``arange(T)`` instead, which this cannot know); the repeat tokens' K/V live in a throw-away cache, never in
  the scored cache.
"""

from __future__ import annotations

import logging
import math
from dataclasses import InitVar, dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..attention import wrapper as attention, kernels
from ..attention.compat import with_cache
from ..models.layout import full_attention_layers
from .base import ModelScorer, Prompt, chunk_size_spelling

logger = logging.getLogger(__name__)

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
_DUMMY = "dummy context"
_QUERY_BLOCK = 128  # repeat queries per softmax block: memory O(block * (chunk + repeat)) per layer


N_SINK = 4  # first real tokens always kept, as kvpress's KVzipPress


@dataclass(kw_only=True)
class KVzipScorer(ModelScorer):
    """Context-reconstruction scores of KVzip (arXiv:2505.23416), faithful to kvpress's ``KVzipPress``.

    Attributes:
        tokenizer: the model's tokenizer (used for the repeat prompts and the chat-template postfix). None: loaded
            from ``model.config.name_or_path`` with ``local_files_only=True`` at the first prompt
            (:func:`~proxykv_hf.models.load_tokenizer`, so the bundled default's name finds its tokenizer too).
        context_chunk: context tokens KVzip reconstructs per forward (kvpress: 2048, reference: 2000).
        prev_postfix_size: tokens of the previous chunk quoted in the prompt of the next one.
        n_sink: first real tokens that join every chunk's softmax (when they precede the chunk), get score 1.0
            and are always kept.
        use_chat_template: take the postfix from the tokenizer's chat template (else ``"\\n"``).
        dtype: dtype of the scoring softmax; None = float32 (the reference uses the model dtype).

    ``tokenizer`` may be given by position; ``chunk_size=`` is the deprecated spelling of ``context_chunk``.

    Example::

        cache = ProxyKVCache(KVzipScorer(tokenizer), keep_ratio=0.3)
        out = model.generate(**inputs, cache=cache, max_new_tokens=32)  # past_key_values= before transformers 5.24

    The scorer runs ``ceil(T / context_chunk)`` extra forwards of about ``context_chunk + 30`` tokens each over the full
    context: about 1-2 prefills of extra compute. Its scores are one softmax over the whole reconstruction, so they
    compare across layers and heads: a cache ranks them under the global budget unless given ``budget=``.
    """

    needs_input_ids = True
    default_budget = "global"

    tokenizer: object = field(default=None, kw_only=False, repr=False)
    context_chunk: int = 2048
    prev_postfix_size: int = 8
    n_sink: int = N_SINK
    use_chat_template: bool = True
    dtype: torch.dtype | None = None
    chunk_size: InitVar[int | None] = None
    _templates: dict[int, tuple] = field(default_factory=dict, init=False, repr=False, compare=False)  # by tokenizer

    def __post_init__(self, chunk_size: int | None = None):
        chunk_size_spelling(self, chunk_size)
        tok = self.tokenizer
        if tok is not None and not (hasattr(tok, "encode") and hasattr(tok, "apply_chat_template")):
            raise ValueError(f"tokenizer must be a transformers tokenizer or None, got {type(tok).__name__}")
        for name, low in (("context_chunk", 1), ("prev_postfix_size", 0), ("n_sink", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.use_chat_template, bool):
            raise ValueError(f"use_chat_template must be a bool, got {self.use_chat_template!r}")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype or None, got {self.dtype!r}")

    # ----------------------------------------------------------------------------------------------- templates
    def _tokenizer_for(self, model) -> object:
        if self.tokenizer is not None:
            return self.tokenizer
        name = getattr(getattr(model, "config", None), "name_or_path", "") or ""
        if not name:
            raise ValueError("KVzipScorer needs a tokenizer: pass KVzipScorer(tokenizer) (the model has no "
                             "name_or_path to load one from)")
        from ..models.loading import load_tokenizer  # resolves the bundled default's name to its converted directory

        try:
            self.tokenizer = load_tokenizer(name, local_files_only=True)
        except Exception as err:  # noqa: BLE001 - any loading failure means: tell the user to pass one
            raise ValueError(f"KVzipScorer could not load the tokenizer of {name!r} offline ({err}); pass "
                             "KVzipScorer(tokenizer)") from err
        return self.tokenizer

    def templates(self, tokenizer) -> tuple[list[int], list[int], list[int]]:
        """Token ids of ``(FIRST_PROMPT, LATER_PROMPT, postfix)`` for ``tokenizer`` (no special tokens added).

        The postfix is what the chat template puts after a user message: render ``[user: "dummy context\\n###..."]``
        with the generation prompt (``enable_thinking=False``) and keep what follows the separator, as kvpress does.
        """
        key = id(tokenizer)
        if key not in self._templates:
            postfix = "\n"
            if self.use_chat_template and getattr(tokenizer, "chat_template", None):
                sep = "\n" + "#" * len(_DUMMY)
                try:
                    text = tokenizer.apply_chat_template([{"role": "user", "content": _DUMMY + sep}],
                                                         add_generation_prompt=True, tokenize=False,
                                                         enable_thinking=False)
                except Exception as err:  # noqa: BLE001 - a template that rejects a lone user message
                    raise ValueError(f"the tokenizer's chat template failed on a user message ({err}); use "
                                     "KVzipScorer(..., use_chat_template=False)") from err
                if not isinstance(text, str) or sep not in text:
                    raise ValueError("could not find the user message in the rendered chat template; "
                                     "use KVzipScorer(..., use_chat_template=False)")
                postfix = text.split(sep)[-1]
            enc = lambda s: list(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
            self._templates[key] = (enc(FIRST_PROMPT), enc(LATER_PROMPT), enc(postfix))
        return self._templates[key]

    def repeat_inputs(self, context_ids: list[int], tokenizer=None) -> list[tuple[int, int, list[int]]]:
        """The chunks of one row's real context tokens and their repeat inputs.

        Args:
            context_ids: the row's real (non-padding) token ids.
            tokenizer: defaults to the scorer's tokenizer.

        Returns:
            ``[(start, end, repeat_ids), ...]``: chunk ``context_ids[start:end]`` and the ids fed to the model for it.
        """
        first, later, postfix = self.templates(tokenizer or self.tokenizer)
        ids, C, P = list(context_ids), self.context_chunk, self.prev_postfix_size
        out = []
        for start in range(0, len(ids), C):
            end = min(start + C, len(ids))
            if start == 0:
                head = first
            else:  # quote the last P tokens of the previous chunk
                head = later + ids[start - min(P, C):start]
            out.append((start, end, head + postfix + ids[start:end]))
        return out

    # ----------------------------------------------------------------------------------------------- Scorer API
    def prepare(self, prompt: Prompt) -> None:
        self.templates(self._tokenizer_for(prompt.model))  # fail before the prefill runs, not after

    def score_all(self, prompt: Prompt, cache) -> dict[int, torch.Tensor]:
        if prompt.input_ids is None:
            raise ValueError("KVzipScorer needs the prompt's input_ids")
        return self.score_layers(prompt.model, prompt.input_ids, prompt.valid, cache.layers,
                                 cache.compactable_layers())

    def score_layers(self, model, input_ids: torch.Tensor, valid: torch.Tensor, context_layers: list,
                     layers: list[int]) -> dict[int, torch.Tensor]:
        """KVzip scores of ``layers``, given cache layers that hold the whole prefill of ``input_ids``.

        Args:
            model: the model (CausalLM or base model) that produced the cache; opted into the ProxyKV attention.
            input_ids: `(B, T)` the prefilled ids, left padded.
            valid: `(B, T)` bool, True on real tokens.
            context_layers: one cache layer per model layer. Full-attention layers hold `(B, H_kv, T, D)`, sliding
                ones their window with ``cumulative_length == T``. Layers not filled yet (a model whose last layers
                follow the last full-attention one) are filled by one extra prefill.
            layers: indices of the full-attention layers to score.

        Returns:
            ``{layer: (B, H_kv, T) float32}``.
        """
        tokenizer = self._tokenizer_for(model)
        attention.use_proxykv_attention(model)  # the repeat queries reach us through the wrapper (no-op if opted in)
        base = getattr(model, "base_model", model)
        B, T = input_ids.shape
        device = context_layers[layers[0]].keys.device
        valid = valid.to(device=device, dtype=torch.bool)
        ids = input_ids.to(device)
        context_layers = _filled_layers(base, ids, valid, context_layers, T)
        n_real = valid.sum(-1)  # (B,)
        pad = T - n_real  # left padding per row, (B,)
        per_row = [self.repeat_inputs(ids[b, pad[b]:].tolist(), tokenizer) for b in range(B)]
        out = {}
        for i in layers:
            keys = context_layers[i].keys
            out[i] = torch.zeros(B, keys.shape[1], T, dtype=torch.float32, device=device)
        pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        n_rounds = max(len(r) for r in per_row)
        logger.debug("KVzip: %d repeat forwards for %d rows of %d tokens", n_rounds, B, T)
        with torch.no_grad():
            for c in range(n_rounds):  # round c: chunk c of every row that has one
                rows = [b for b in range(B) if c < len(per_row[b])]
                chunks = [per_row[b][c] for b in rows]
                Q = max(len(rep) for _, _, rep in chunks)
                rep_ids = torch.full((len(rows), Q), pad_id, dtype=torch.long, device=device)
                rep_valid = torch.zeros(len(rows), Q, dtype=torch.bool, device=device)
                for r, (_, _, rep) in enumerate(chunks):  # right padding: real repeat tokens at the row-alone index
                    rep_ids[r, :len(rep)] = torch.tensor(rep, device=device)
                    rep_valid[r, :len(rep)] = True
                row_idx = torch.tensor(rows, device=device)
                record = _ChunkRecorder(
                    T=T, n_sink=min(self.n_sink, c * self.context_chunk), pad=pad[row_idx],
                    starts=pad[row_idx] + c * self.context_chunk, rep_valid=rep_valid,
                    dtype=self.dtype or torch.float32,
                    lengths=torch.tensor([e - s for s, e, _ in chunks], device=device),
                )
                temp = _RepeatCache(context_layers, None if len(rows) == B else row_idx, T,
                                    {i: _LayerCall(record, i) for i in layers})
                position_ids = n_real[row_idx, None] + torch.arange(Q, device=device)  # (R, Q) after the real context
                mask = torch.cat([valid[row_idx], rep_valid], dim=1).long()  # (R, T + Q)
                base(input_ids=rep_ids, attention_mask=mask, position_ids=position_ids, **with_cache(temp),
                     use_cache=True)
                for i in layers:
                    if i not in record.scores:
                        raise RuntimeError(f"KVzip got no queries from layer {i}: its attention did not go through "
                                           f"the ProxyKV wrapper (attn_implementation "
                                           f"{model.config._attn_implementation!r})")
                    best = record.scores.pop(i)  # (R, H_kv, L_max)
                    for r, b in enumerate(rows):
                        s0, n = int(record.starts[r]), int(record.lengths[r])
                        out[i][b, :, s0:s0 + n] = best[r, :, :n]
        sink = (valid.long().cumsum(-1) <= self.n_sink) & valid  # (B, T) first n_sink real tokens
        for i in layers:
            out[i].masked_fill_(sink[:, None, :], 1.0)
        return out


# --------------------------------------------------------------------------------------------------- the forward
def _filled_layers(base, ids, valid, layers, T: int) -> list:
    """``layers``, with those not holding the whole prefill yet replaced by the layers of a fresh prefill."""

    def ready(layer) -> bool:
        if not getattr(layer, "is_initialized", False) or getattr(layer, "keys", None) is None \
                or layer.get_seq_length() != T:
            return False
        return bool(getattr(layer, "is_sliding", False)) or layer.keys.shape[-2] == T

    if all(ready(layer) for layer in layers):
        return list(layers)
    logger.debug("KVzip: some cache layers are not prefilled yet; running one extra prefill for them")
    fresh = DynamicCache(config=base.config)
    with torch.no_grad():
        base(input_ids=ids, attention_mask=valid.long(), position_ids=(valid.long().cumsum(-1) - 1).clamp_min(0),
             **with_cache(fresh), use_cache=True)
    return [layer if ready(layer) else fresh.layers[i] for i, layer in enumerate(layers)]


class _RepeatCache(DynamicCache):
    """Throw-away cache for one repeat forward: it shows every layer its context K/V (rows ``rows`` only) and stores
    nothing, so the repeat tokens never reach the scored cache. Scored layers leave a hand-off for the attention."""

    def __init__(self, context_layers: list, rows: torch.Tensor | None, T: int, calls: dict):
        super().__init__()
        self.layer_class_to_replicate = None
        self.rows, self.calls = rows, calls
        self.layers = []
        for src in context_layers:
            if getattr(src, "is_sliding", False):
                layer = DynamicSlidingWindowLayer(sliding_window=src.sliding_window)
                layer.cumulative_length = T  # the window content stands for a logical length T
            else:
                layer = DynamicLayer()
            layer.keys, layer.values = src.keys, src.values  # references, no copy
            layer.dtype, layer.device, layer.is_initialized = src.keys.dtype, src.keys.device, True
            self.layers.append(layer)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        keys, values = layer.keys, layer.values
        if self.rows is not None:
            keys, values = keys[self.rows], values[self.rows]
        if layer_idx in self.calls:
            attention.set_pending(self.calls[layer_idx])
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)


class _LayerCall:
    """Pending call (see :mod:`proxykv_hf.attention`) that hands one layer's repeat queries to the recorder."""

    def __init__(self, record: "_ChunkRecorder", layer_idx: int):
        self.record, self.layer_idx = record, layer_idx

    def before(self, module, attention_mask, query, key):
        if getattr(module, "layer_idx", self.layer_idx) != self.layer_idx:
            raise RuntimeError(f"KVzip hand-off for layer {self.layer_idx} reached layer {module.layer_idx}")
        impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if self.record.unpadded and attention_mask is not None and impl == attention.PREFIX + "sdpa":
            # no padding anywhere: the mask is the whole context plus the repeat up to each query, i.e. causal
            # aligned to the last key. Said as such, sdpa may run a flash kernel (a materialised mask rules flash
            # out on CUDA); elsewhere it materialises the same mask itself.
            from torch.nn.attention.bias import causal_lower_right

            return causal_lower_right(query.shape[2], key.shape[2])
        return attention_mask

    def after(self, module, query, key, value, attention_mask, scaling):
        self.record.scores[self.layer_idx] = self.record.score(query, key, scaling)


class _ChunkRecorder:
    """The chunk of one repeat forward (rows ``R``) and the scores it produced per layer, `(R, H_kv, L_max)`."""

    def __init__(self, *, T, n_sink, pad, starts, lengths, rep_valid, dtype):
        self.T, self.n_sink, self.starts, self.lengths, self.rep_valid, self.dtype = \
            T, n_sink, starts, lengths, rep_valid, dtype
        # no left padding in the rows' context and none in their repeat inputs: the mask is plain causal
        self.unpadded = not bool(pad.any()) and bool(rep_valid.all())
        L_max = int(lengths.max())
        device = starts.device
        sink_pos = pad[:, None] + torch.arange(n_sink, device=device)  # (R, S)
        chunk_pos = starts[:, None] + torch.arange(L_max, device=device)  # (R, L_max)
        self.index = torch.cat([sink_pos, chunk_pos.clamp_max(T - 1)], dim=1)  # (R, S + L_max)
        chunk_ok = torch.arange(L_max, device=device)[None, :] < lengths[:, None]  # (R, L_max)
        ctx_ok = torch.cat([torch.ones_like(sink_pos, dtype=torch.bool), chunk_ok], dim=1)  # (R, S + L_max)
        # True on context columns past a short chunk (padded batches only); None when every column is real
        self.ctx_masked = None if bool(ctx_ok.all()) else ~ctx_ok[:, None, None, None, :]
        # every context column real and a float32 softmax: the fused kernels compute the same scores where they run
        self.fusable = self.ctx_masked is None and dtype == torch.float32
        self.scores: dict[int, torch.Tensor] = {}

    def _keys(self, key: torch.Tensor) -> torch.Tensor:
        """`(R, H_kv, T + Q, D)` -> the keys of the softmax, `(R, H_kv, S + L_max + Q, D)`: the sinks, the chunk,
        the repeat keys."""
        R, H_kv, _, D = key.shape
        idx = self.index[:, None, :, None].expand(R, H_kv, self.index.shape[1], D)
        return torch.cat([key[:, :, :self.T].gather(2, idx), key[:, :, self.T:]], dim=2)

    def score(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
        """Max over queries and group of softmax(q k^T) over [sinks, chunk, repeat (causal)], chunk columns only.

        Args:
            query: `(R, H, Q, D)` repeat queries (after RoPE).
            key: `(R, H_kv, T + Q, D)` context keys followed by the repeat keys.

        Where the fused kernels run (:attr:`fusable`, a GPU with Triton): the repeat queries see the softmax's keys
        as a causal prompt whose last ``Q`` positions they hold, so the kernels' per-key maximum over the queries
        (:func:`kernels.causal_attention_sums`) is the score of each chunk column, in two tiled passes that never
        write the probabilities. Elsewhere the queries go in blocks of ``_QUERY_BLOCK``; a block's logits stop at
        its last query's own key (every later repeat key is masked for all of its queries), and the softmax is
        normalised in place.
        """
        R, H, Q, D = query.shape
        H_kv = key.shape[1]
        G = H // H_kv
        S, L = self.n_sink, self.index.shape[1] - self.n_sink
        n_ctx = S + L
        if self.fusable and kernels.available(query):
            _, top = kernels.causal_attention_sums(query, self._keys(key), scaling, self.rep_valid, with_max=True)
            return top[:, :, S:n_ctx].view(R, H_kv, G, L).amax(2)  # chunk columns, max over the group
        keys_t = self._keys(key).to(self.dtype).transpose(-1, -2)  # (R, H_kv, D, S + L + Q)
        best = torch.zeros(R, H_kv, L, dtype=self.dtype, device=query.device)
        for q0 in range(0, Q, _QUERY_BLOCK):
            q1 = min(q0 + _QUERY_BLOCK, Q)
            C = q1 - q0
            q = (query[:, :, q0:q1].to(self.dtype) * scaling).reshape(R, H_kv, G * C, D)  # heads h = kv * G + g
            logits = torch.matmul(q, keys_t[..., :n_ctx + q1]).view(R, H_kv, G, C, n_ctx + q1)
            if self.ctx_masked is not None:
                logits[..., :n_ctx].masked_fill_(self.ctx_masked, -math.inf)
            diag = torch.ones(C, C, dtype=torch.bool, device=query.device).triu_(1)  # query i sees repeat keys <= i
            logits[..., n_ctx + q0:].masked_fill_(diag, -math.inf)
            # softmax over [sinks, chunk, repeat]: every query sees its own key, so each row's max is finite
            logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
            inv = logits.sum(dim=-1, keepdim=True).reciprocal_()  # (R, H_kv, G, C, 1)
            inv.mul_(self.rep_valid[:, None, None, q0:q1, None])  # padding queries vote nothing
            probs = logits[..., S:n_ctx].mul_(inv)  # chunk columns
            best = torch.maximum(best, probs.amax(dim=(2, 3)))
        return best.float()


# --------------------------------------------------------------------------------------------------- functional
def kvzip_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, tokenizer=None,
                 **kwargs) -> torch.Tensor:
    """Raw KVzip scores of every layer for a (left padded) batch: runs the prefill and the reconstruction.

    Args:
        model: a supported model (CausalLM or base model), sdpa or eager attention. It is opted into the ProxyKV
            attention wrapper (a pass-through for other caches).
        input_ids: `(B, T)` token ids.
        attention_mask: `(B, T)` 1 on real tokens, 0 on left padding; None = no padding.
        tokenizer: the model's tokenizer (see :class:`KVzipScorer`).
        **kwargs: :class:`KVzipScorer` options (``context_chunk``, ``prev_postfix_size``, ``n_sink``, ...).

    Returns:
        `(L, B, H_kv, T)` float32 scores. Sliding-window layers are not scored (ProxyKV keeps them as they are) and
        hold zeros; :func:`full_attention_layers` lists the scored ones. Padding scores 0.
    """
    scorer = KVzipScorer(tokenizer, **kwargs)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D (B, T), got shape {tuple(input_ids.shape)}")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if valid.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(valid.shape)} != input_ids shape {tuple(input_ids.shape)}")
    if bool((valid.sum(-1) == 0).any()):
        raise ValueError("a batch row of input_ids is all padding")
    if bool((valid.long().cummax(-1).values.bool() & ~valid).any()):
        raise ValueError("kvzip_scores needs left padding (tokenizer.padding_side = 'left')")
    layers = full_attention_layers(model)
    if not layers:
        raise ValueError("the model has no full-attention layer to score")
    attention.use_proxykv_attention(model)
    base = getattr(model, "base_model", model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        base(input_ids=input_ids, attention_mask=valid.long(), **with_cache(cache), use_cache=True,
             position_ids=(valid.long().cumsum(-1) - 1).clamp_min(0))
    scores = scorer.score_layers(model, input_ids, valid, cache.layers, layers)
    first = scores[layers[0]]
    out = torch.zeros(len(cache.layers), *first.shape, dtype=torch.float32, device=first.device)  # (L, B, H_kv, T)
    for i, s in scores.items():
        out[i] = s
    return out

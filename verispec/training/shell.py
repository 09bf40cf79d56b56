"""The shell every training kind shares: batches, options, warm start, the teacher, held-out
evaluation and export. A kind (verispec.training.kinds.*, registered in recipes.RECIPES) brings
only what is its own: its module, its loss, its features and the options it reads.

All kinds learn from the same data (verispec.training.data): token ids, the target's final
hidden states h (its logits are h @ lm_head.T), its exit-layer states and, where built with them,
its aux-layer states. Teacher distributions are the target's logits restricted to the drafter's
reduced vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from verispec.core.errors import VerispecError
from verispec.drafters.learned import ReducedHead, frequent_tokens, load_drafter, save_drafter
from verispec.model.loading import LoadedModel
from verispec.training.data import Sequence
from verispec.training.losses import agreement, agreement_rates, distill_loss, head_distillation


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor  # [B, T] int64
    hidden: torch.Tensor  # [B, T, hidden] float32: the target's final hidden states
    # [B, T, hidden] float32: the states after the data's exit layer (a trained early exit,
    # EAGLE's --mid-state); None where the kind never reads them or the data has none
    exit_hidden: torch.Tensor | None
    mask: torch.Tensor  # [B, T] bool: real (not padding) positions
    # [B, T] bool: real positions whose next token belongs to the answer (or corpus passage):
    # the predictions a drafter makes while decoding; the prompt's are trained on, not drafted.
    answer: torch.Tensor
    # [B, T, hidden * len(aux_layers)] float32: the states after the data's aux layers (EAGLE-3),
    # None where the data has none
    aux: torch.Tensor | None = None


def collate(items: list[Sequence], max_len: int, device: torch.device | str = "cpu",
            aux: bool = True, exit: bool = True) -> Batch:
    """Right-pad sequences (each cut to its last max_len tokens) into one batch on `device`;
    aux False leaves out the aux-layer states (three states wide) and exit False the exit-layer
    states, for kinds that never read them (no copy made).

    For another device than the CPU the batch is laid out in the data's own float16 and widened
    to float32 there: the copy moves half the bytes, and the CPU makes no conversion pass."""
    cut = [max(0, len(s.tokens) - max_len) for s in items]  # tokens dropped from each start
    items = [Sequence(s.tokens[-max_len:], max(0, s.prompt_len - dropped), s.hidden[-max_len:],
                      None if s.exit_hidden is None or not exit else s.exit_hidden[-max_len:],
                      None if s.aux_hidden is None or not aux else s.aux_hidden[-max_len:])
             for s, dropped in zip(items, cut)]
    width = max(len(s.tokens) for s in items)
    size = items[0].hidden.shape[-1]
    # float32 on the CPU (each row widened as it is copied), else the data's own (float16)
    stored = torch.float32 if torch.device(device).type == "cpu" else items[0].hidden.dtype
    cpu = torch.device("cpu")  # the layout is built here whatever the default device is
    tokens = torch.zeros(len(items), width, dtype=torch.int64, device=cpu)
    hidden = torch.zeros(len(items), width, size, dtype=stored, device=cpu)
    with_exit = all(s.exit_hidden is not None for s in items)
    exit_hidden = torch.zeros_like(hidden) if with_exit else None
    mask = torch.zeros(len(items), width, dtype=torch.bool, device=cpu)
    answer = torch.zeros_like(mask)
    with_aux = all(s.aux_hidden is not None for s in items)
    aux = (torch.zeros(len(items), width, items[0].aux_hidden.shape[-1], dtype=stored, device=cpu)
           if with_aux else None)
    for row, s in enumerate(items):
        n = len(s.tokens)
        tokens[row, :n], mask[row, :n] = s.tokens, True
        answer[row, max(0, s.prompt_len - 1): n] = True
        hidden[row, :n] = s.hidden
        if exit_hidden is not None:
            exit_hidden[row, :n] = s.exit_hidden
        if aux is not None:
            aux[row, :n] = s.aux_hidden

    def states(t: torch.Tensor) -> torch.Tensor:
        return t.to(device).float()

    return Batch(tokens.to(device), states(hidden), None if exit_hidden is None else states(exit_hidden),
                 mask.to(device), answer.to(device), None if aux is None else states(aux))


@dataclass(frozen=True)
class RecipeOptions:
    """Every kind's options, declared once; a kind names the ones it reads (Kind.options)."""

    loss: str = "fkl"  # distillation loss: fkl, rkl or tvd
    vocab: int = 8192  # reduced draft vocabulary (most frequent answer tokens)
    heads: int = 4  # Medusa, Hydra and MTP heads
    unroll: int = 2  # EAGLE: also train on its own predicted features, this many steps deep
    feature_weight: float = 1.0  # EAGLE: feature regression weight (token loss weight is 0.1)
    exit_layer: int | None = None  # early exit: default from the data
    draft_layers: int = 2  # distilled draft model and block drafter: their own layers
    block: int = 8  # block drafter: rows of a block (the newest token, then block - 1 drafted)
    init: str | None = None  # start from this trained drafter's weights (same kind and target)
    mid_state: bool = False  # EAGLE: also read the target's state at the data's exit layer
    # EAGLE-3: train its own lm_head (it starts as the target's rows of the draft vocabulary)
    train_head: bool = True

    def __post_init__(self) -> None:
        if self.heads < 1:
            raise VerispecError(f"--heads must be >= 1 (draft heads to train), got {self.heads}")
        if self.block < 2:
            raise VerispecError(f"--block must be >= 2 (the newest token and a slot), got {self.block}")


# Options every kind reads; the rest belong to the kinds that name them.
SHARED_OPTIONS = frozenset({"loss", "vocab", "init"})
Built = tuple[dict, nn.Module]  # a kind's settings (drafter.json) and its trainable module


@dataclass(frozen=True)
class Kind:
    """One trainable drafter kind: everything the shell, `verispec train` and the export ask."""

    name: str  # its drafter's own `kind`
    build: Callable[[Recipe, dict, list[Sequence]], Built]  # (recipe so far, data meta, data)
    loss: Callable[[Recipe, Batch], tuple[torch.Tensor | None, dict]]
    options: frozenset[str] = frozenset()  # the RecipeOptions fields it reads beyond SHARED_OPTIONS
    prefix: str = "net."  # key prefix of the kind's own weights in weights.safetensors
    # Drafts through the target's LM head restricted to its own vocabulary (vocab_ids, exported)
    reduced_vocab: bool = True
    # Static-tree kinds (heads that read only the target's states): every head's features at
    # every position [B, T, heads, hidden], whose measured rank accuracy shapes the tree
    head_features: Callable[[Recipe, Batch], torch.Tensor] | None = None
    reads_aux: bool = False  # trains on the target's states after its aux layers (EAGLE-3)
    reads_exit: bool = False  # trains on the target's states after its exit layer (early exit)
    own_head: bool = False  # its own head's rows are its vocabulary's: a warm start keeps both

    def __post_init__(self) -> None:
        unknown = self.options - {f.name for f in fields(RecipeOptions)}
        if unknown:
            raise ValueError(f"kind {self.name} names options RecipeOptions lacks: {sorted(unknown)}")

    @property
    def static_tree(self) -> bool:
        return self.head_features is not None


class Recipe:
    """Binds a drafter kind to the target and data: module, loss function, export."""

    def __init__(self, kind: Kind, target: LoadedModel, meta: dict, sequences: list[Sequence],
                 options: RecipeOptions) -> None:
        model = target.model
        self.kind, self.spec, self.target, self.options = kind.name, kind, model, options
        # the exit-layer states: a kind's own, or EAGLE's fused --mid-state input
        self.reads_exit = kind.reads_exit or options.mid_state
        if self.reads_exit and any(s.exit_hidden is None for s in sequences):
            raise VerispecError(f"the {kind.name} drafter{' with --mid-state' * options.mid_state} "
                                "trains on the target's states after its exit layer: this data was "
                                "built without them (its --for named no kind that reads them)")
        self.device = model.device  # the kind's module, the batches and the head live there
        answers = [s.tokens[s.prompt_len:] for s in sequences]
        self.vocab_ids = frequent_tokens(answers, target.vocab_size, options.vocab,
                                         set(target.eos_token_ids))
        self.head = ReducedHead(model, self.vocab_ids)
        self.head_t = self.head.weight_t.float()  # [hidden, reduced]
        self.embed = model.get_input_embeddings().weight.detach().float()  # [vocab, hidden]
        self.settings, self.module = kind.build(self, meta, sequences)
        if options.init is not None:
            self._warm_start(Path(options.init))
        self.module.to(self.device)

    def _warm_start(self, path: Path) -> None:
        """Load a trained drafter's own weights (its vocabulary is not kept: the network does not
        depend on it, and the reduced vocabulary follows the new data; except for EAGLE-3, whose
        own head is its vocabulary's)."""
        config, weights = load_drafter(path, self.target, self.kind)
        own = self.own_weights(weights)
        if self.spec.own_head:  # its own head's rows are its vocabulary's: both are kept
            self.use_vocabulary(weights["vocab_ids"])
            self.settings["draft_vocab"] = len(self.vocab_ids)
        unfused = {k: v for k, v in self.settings.items() if k != "mid_layer"}
        if unfused != self.settings and config["settings"] == unfused:
            self.module.load_unfused(own)  # an EAGLE drafter without the mid-layer input
            return
        if config["settings"] != self.settings:
            raise VerispecError(f"the {self.kind} drafter in {path} has settings {config['settings']}, "
                                f"not {self.settings}: it cannot start this run")
        self.module.load_state_dict(own)

    def own_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The kind's module's state dict from a trained drafter's weights (float32)."""
        prefix = self.spec.prefix
        return {k.removeprefix(prefix): v.float() for k, v in weights.items() if k.startswith(prefix)}

    def use_vocabulary(self, vocab_ids: torch.Tensor) -> None:
        """Draft over these token ids [reduced] (a trained drafter's) instead of the data's."""
        self.vocab_ids = vocab_ids.long()
        self.head = ReducedHead(self.target, self.vocab_ids)
        self.head_t = self.head.weight_t.float()

    def teacher(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits over the reduced vocabulary. hidden [..., hidden] -> [..., reduced]."""
        return hidden @ self.head_t

    def head_distillation(self, hidden: torch.Tensor, b: Batch) -> tuple[torch.Tensor, dict]:
        """(loss, metrics) of a student whose final states hidden [batch, len, hidden] are read
        through the target's head, fitted to the target's own (b.hidden): the distillation loss
        and the top-1 agreement (the distilled draft model's, a trained early exit's)."""
        value, same = head_distillation(hidden[b.mask], b.hidden[b.mask], self.head_t, self.options.loss)
        return value, {"loss": float(value.detach()), **agreement_rates("top1", same, b.answer[b.mask])}

    def loss(self, items: list[Sequence], max_len: int) -> tuple[torch.Tensor | None, dict]:
        """(loss, metrics) of a batch; loss None where the kind has run its backward itself (MTP,
        while gradients are on)."""
        return self.spec.loss(self, self.collate(items, max_len))

    def collate(self, items: list[Sequence], max_len: int) -> Batch:
        """A batch of items holding the states this kind reads (collate)."""
        return collate(items, max_len, self.device, self.spec.reads_aux, self.reads_exit)

    def head_term(self, k: int, student: torch.Tensor, teacher_all: torch.Tensor,
                  b: Batch) -> tuple[torch.Tensor, dict]:
        """Loss and agreement of head k, whose prediction at t is the target's at t + k.
        student: [B, T - k, reduced]; teacher_all: [B, T, reduced]."""
        teacher, m = teacher_all[:, k:], b.mask[:, k:]
        return (distill_loss(student, teacher, self.options.loss, m),
                agreement(f"top1_head{k}", student, teacher, m, b.answer[:, k:]))

    @torch.no_grad()
    def rank_accuracy(self, items: list[Sequence], max_len: int, ranks: int = 8,
                      chunk: int = 8) -> list[list[float]]:
        """Static-tree kinds: [head][r], how often head k's r-th most probable token is the
        target's own choice k positions on, over the given (held-out) sequences; shapes the tree."""
        if self.spec.head_features is None:
            raise VerispecError(f"a {self.kind} drafter has no static tree to measure")
        heads: int | None = None
        hits = counts = torch.zeros(0)
        for start in range(0, len(items), chunk):
            b = self.collate(items[start: start + chunk], max_len)
            features = self.spec.head_features(self, b)  # [B, T, heads, hidden]
            if heads is None:
                heads = features.shape[2]
                hits = torch.zeros(heads, ranks, device=self.device)
                counts = torch.zeros(heads, device=self.device)
            target_top = self.teacher(b.hidden).argmax(-1)  # [B, T]
            for k in range(1, heads + 1):
                ranked = self.teacher(features[:, :-k, k - 1]).topk(ranks, dim=-1).indices
                m = b.mask[:, k:]
                hits[k - 1] += (ranked == target_top[:, k:, None])[m].sum(0)
                counts[k - 1] += m.sum()
        return (hits / counts.clamp_min(1)[:, None]).tolist()

    def export(self, out_dir: Path, extra: dict) -> Path:
        weights = {self.spec.prefix + k: v for k, v in self.module.state_dict().items()}
        if self.spec.reduced_vocab:
            weights["vocab_ids"] = self.vocab_ids
        return save_drafter(out_dir, self.kind, self.target, dict(self.settings), weights, extra)


def require_aux(meta: dict, sequences: list[Sequence], who: str) -> None:
    """Refuse data without the target's aux-layer states (EAGLE-3, the block drafter)."""
    if "aux_layers" not in meta or any(s.aux_hidden is None for s in sequences):
        raise VerispecError(f"{who} trains on the target's states after its aux layers: this "
                            "data has none (`verispec train eagle3` and `verispec train block` "
                            "build data with them; use a new --data directory)")

"""Terminal rendering: text coloured by each token's fate, as in Leviathan et al.'s figure."""

from __future__ import annotations

from verispec.core.tree import children
from verispec.core.types import DraftTree, Fate, GenerationStats, Step

GREEN, RED_STRIKE, BLUE, CYAN, MAGENTA, RESET = ("\033[32m", "\033[31;9m", "\033[34m", "\033[36m",
                                                "\033[35m", "\033[0m")
FATE_COLOURS = {Fate.ACCEPTED: GREEN, Fate.FORCED: MAGENTA, Fate.RECOVERED: BLUE, Fate.BONUS: CYAN}
LEGEND = (f"{GREEN}accepted draft{RESET}  {RED_STRIKE}rejected draft{RESET}  "
          f"{BLUE}target correction{RESET}  {CYAN}bonus token{RESET}")
FORCED_LEGEND = f"  {MAGENTA}forced by the grammar{RESET}"


class TokenPieces:
    """Each committed token's own piece of text, decoded in context, and the rejected draft text
    shown (struck out) before a target correction. A character split across tokens arrives with
    the token that completes it. The CLI's colours, the server's stream and verispec.stream all
    come from here.

    Incremental: each token decodes only the few tokens since the last complete piece (with
    the piece before them as context, for tokenizers whose decoding of a token depends on what
    precedes it), so the work per token does not grow with the answer (vLLM and Hugging Face's
    TextStreamer do the same).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        # tokens[context:shown] gave the last piece (the context of the next); tokens[:shown]
        # have been shown, tokens[shown:] wait for a character to complete.
        self.context = 0
        self.shown = 0

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _after(self, more: list[int]) -> str:
        """The text that tokens[shown:] + more add after what has been shown."""
        before = self._decode(self.tokens[self.context: self.shown])
        return self._decode(self.tokens[self.context:] + more)[len(before):]

    def push(self, step: Step) -> tuple[list[str], list[str]]:
        """The step's tokens' pieces, and the rejected draft text before each ("" if none)."""
        pieces, rejected = [], []
        for token, fate in zip(step.tokens, step.fates):
            struck = ""
            if fate is Fate.RECOVERED and step.rejected:
                struck = self._after(step.rejected[:1])
            rejected.append(struck)
            self.tokens.append(token)
            piece = self._after([])
            if not piece or piece.endswith("\ufffd"):  # nothing yet, or a character in pieces
                pieces.append("")
                continue
            pieces.append(piece)
            self.context, self.shown = self.shown, len(self.tokens)
        return pieces, rejected


def render_steps(steps: list[Step], tokenizer, colour: bool = True) -> str:
    """The generated text; with colour, each token painted by fate and rejected drafts struck out.

    Steps without a draft (plain decoding) stay uncoloured.
    """
    if not colour:
        return tokenizer.decode([t for s in steps for t in s.tokens], skip_special_tokens=True)
    out: list[str] = []
    text = TokenPieces(tokenizer)
    for step in steps:
        pieces, rejected = text.push(step)
        for piece, struck, fate in zip(pieces, rejected, step.fates):
            if struck:
                out.append(f"{RED_STRIKE}{struck}{RESET}")
            painted = step.num_drafted > 0 and piece
            out.append(f"{FATE_COLOURS[fate]}{piece}{RESET}" if painted else piece)
    return "".join(out)


def stats_table(rows: dict[str, GenerationStats]) -> str:
    """A small fixed-width table, one row per method."""
    header = (f"{'method':<14}{'tokens':>8}{'forwards':>10}{'tau':>7}{'tok/s':>9}{'draft s':>9}"
              f"{'verify s':>10}")
    lines = [header, "-" * len(header)]
    for name, s in rows.items():
        lines.append(f"{name:<14}{s.new_tokens:>8}{s.target_forwards:>10}{s.mean_accepted_tokens:>7.2f}"
                     f"{s.tokens_per_second:>9.1f}{s.draft_seconds:>9.2f}{s.verify_seconds:>10.2f}")
    return "\n".join(lines)


def acceptance_line(stats: GenerationStats, limit: int = 12) -> str:
    rates = stats.acceptance_by_position[:limit]
    return "acceptance by draft position: " + (" ".join(f"{r:.2f}" for r in rates) or "(no drafts)")


def chosen(stats: GenerationStats) -> str:
    """What a choosing drafter (`auto`) drafted with: tokens and stretches per method, most first.

    >>> chosen(GenerationStats(new_tokens=30, choices=[(0, "ar", 0), (4, "suffix", 7), (20, "ar", 0)]))
    'suffix 16 tokens in 1 stretch (k <= 7), ar 14 tokens in 2 stretches'
    """
    ends = [start for start, _, _ in stats.choices[1:]] + [stats.new_tokens]
    tokens: dict[str, list[int]] = {}  # method -> [tokens, stretches, longest k]
    for (start, method, k), end in zip(stats.choices, ends):
        total = tokens.setdefault(method, [0, 0, 0])
        total[0], total[1], total[2] = total[0] + end - start, total[1] + 1, max(total[2], k)
    return ", ".join(f"{method} {count} tokens in {runs} stretch{'es' if runs > 1 else ''}"
                     + (f" (k <= {k})" if k else "")
                     for method, (count, runs, k) in sorted(tokens.items(), key=lambda item: -item[1][0]))


def choices_line(stats: GenerationStats, shown: int = 8) -> str:
    """`chosen`, then the first stretches as `token index: method k`.

    >>> print(choices_line(GenerationStats(new_tokens=30, choices=[(0, "ar", 0), (4, "suffix", 7)])))
    chose: suffix 26 tokens in 1 stretch (k <= 7), ar 4 tokens in 1 stretch; stretches: 0: ar, 4: suffix k7
    """
    stretches = [f"{start}: {method}" + (f" k{k}" if k else "") for start, method, k in stats.choices[:shown]]
    more = ", ..." if len(stats.choices) > shown else ""
    return f"chose: {chosen(stats)}; stretches: {', '.join(stretches)}{more}"


def render_tree(tree: DraftTree, tokenizer) -> str:
    """A drafted token tree, one node per line under the root; accepted nodes marked with '*'.

    >>> print(render_tree(DraftTree([5, 6, 7], [-1, 0, -1], [0], 2), None))
    (root)
    ├─* 5
    │  └── 6
    └── 7
    """
    kids = children(tree.parents)
    accepted = set(tree.path)
    lines = ["(root)"]

    def show(token: int) -> str:
        return repr(tokenizer.decode([token])) if tokenizer is not None else str(token)

    def walk(row: int, indent: str) -> None:
        for i, node in enumerate(kids[row]):
            last = i == len(kids[row]) - 1
            mark = "*" if node in accepted else "─"
            lines.append(f"{indent}{'└─' if last else '├─'}{mark} {show(tree.tokens[node])}")
            walk(node + 1, indent + ("   " if last else "│  "))

    walk(0, "")
    return "\n".join(lines)

"""EAGLE drafters as fixed-shape passes (verispec.drafters.graphed), the way they run on a GPU.

On a GPU an EAGLE drafter's network runs as passes of ROWS rows over a fixed key buffer, each row
attending through a mask, so that each pass can be captured as a CUDA graph. The passes are
forced here on the CPU (run eagerly, no graph) and checked against the network's own calls: the
same features for a block longer than one pass, chain steps, a tree level and a rewind; and in the
engine, the same drafts and the output of plain decoding. The capture itself needs a GPU:
test_invariance's CUDA cases and docs/invariance.md.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny import VOCAB, plain_greedy, save_tiny
from verispec.core.policies import ConstantK
from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.eagle import EagleDrafter, EagleNet, eagle_settings
from verispec.drafters.eagle3 import Eagle3Drafter, Eagle3Net, eagle3_settings
from verispec.drafters.graphed import ROWS
from verispec.drafters.hybrid import LookupThenModel
from verispec.drafters.learned import ReducedHead
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.model.loading import load_model

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: no GPU on this machine")
# float32 both ways; the passes attend over a masked whole buffer, the network over its cache's
# filled part: the same sums up to rounding, far below any flip of these random nets' drafts.
ATOL = 1e-5
KINDS = ["eagle", "mid-eagle", "eagle3"]
# At full precision: in 8 bits a product rounds its inputs to bfloat16, which turns those last-bit
# differences into visible ones now and then; the passes are the same mechanism either way.
pytestmark = pytest.mark.usefixtures("full_precision_drafting")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(str(save_tiny(tmp_path_factory.mktemp("target"), seed=0))).model


def drafter(model, kind: str, passes: bool, tree: TreeSettings | None = None) -> EagleDrafter:
    """A randomly initialised drafter of `kind` (the same weights every call), its network run as
    fixed-shape passes where `passes`."""
    torch.manual_seed(5)
    vocab_ids = torch.arange(3, VOCAB - 5)
    if kind == "eagle3":
        net = Eagle3Net(**eagle3_settings(model, None, len(vocab_ids)))
    else:
        net = EagleNet(**eagle_settings(model), mid_layer=1 if kind == "mid-eagle" else None)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.3)
    forced = True if passes else None  # None: the device decides (a GPU's run as passes)
    made = (Eagle3Drafter(model, net, vocab_ids, tree=tree, passes=forced) if kind == "eagle3"
            else EagleDrafter(model, net, ReducedHead(model, vocab_ids), tree=tree, passes=forced))
    assert (made.graphed is None) == (not passes and model.device.type == "cpu")
    return made


@pytest.mark.parametrize("kind", KINDS)
def test_passes_compute_what_the_network_computes(model, kind):
    eager, passes = drafter(model, kind, False), drafter(model, kind, True)
    width = model.config.hidden_size * (1 + len(eager.hidden_layers))  # final state, then each layer's
    generator = torch.Generator().manual_seed(0)
    real = ROWS * 2 + 3  # more rows than one pass holds
    tokens = torch.randint(3, VOCAB, (real + 8,), generator=generator)
    states = torch.randn(real + 8, width, generator=generator)
    with torch.inference_mode():
        outs = [d._run(tokens[1: real + 1], states[:real], torch.arange(real)) for d in (eager, passes)]
        torch.testing.assert_close(outs[1], outs[0], atol=ATOL, rtol=0)
        assert eager.cache.length == passes.cache.length == real
        feature = outs[0][-1]
        for step in range(3):  # chain steps from predicted features
            outs = [d._net(tokens[real + step].view(1), feature.view(1, -1), torch.tensor([real + step]))
                    for d in (eager, passes)]
            torch.testing.assert_close(outs[1], outs[0], atol=ATOL, rtol=0)
            feature = outs[0][-1]
        # a tree level: two nodes under the last one, each seeing the real context and that node
        past = eager.cache.length
        mask = torch.zeros(2, past + 2, dtype=torch.bool)
        mask[:, :real] = True
        mask[:, past - 1] = True
        mask[0, past], mask[1, past + 1] = True, True
        inputs = torch.stack([feature, feature])
        outs = [d._net(tokens[:2], inputs, torch.tensor([past, past]), mask) for d in (eager, passes)]
        torch.testing.assert_close(outs[1], outs[0], atol=ATOL, rtol=0)
        for d in (eager, passes):  # verified: back to the real positions, then on from there
            d.cache.rewind(real)
        outs = [d._run(tokens[real + 1: real + 6], states[real: real + 5], torch.arange(real, real + 5))
                for d in (eager, passes)]
        torch.testing.assert_close(outs[1], outs[0], atol=ATOL, rtol=0)
    passes.reset()
    assert passes.cache.length == 0 and passes.cache.keys is not None  # fixed buffers are kept


PROMPT, NEW = [1, 17, 42, 9, 33, 17, 42, 5], 40


def decode(model, used, made: EagleDrafter) -> tuple[list[int], list]:
    """Greedy output of `used` (the drafter `made`, or a drafter around it) at k = 3, and the
    proposals `made` drafted."""
    seen = []
    propose = made.propose
    made.propose = lambda request: seen.append(propose(request)) or seen[-1]
    engine = SpeculativeEngine(model, used, ConstantK(3))
    return engine.generate(SequenceSpec(PROMPT, StoppingRules.build(NEW))).token_ids, seen


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", ["chain", "tree", "pld"])
def test_drafting_through_passes_drafts_alike_and_decodes_exactly(model, kind, shape):
    truth = plain_greedy(model, PROMPT, NEW)
    proposals = {}
    for passes in (False, True):
        made = drafter(model, kind, passes, TreeSettings(3, 10) if shape == "tree" else None)
        used = LookupThenModel(PromptLookupDrafter(2, 1), made, 3) if shape == "pld" else made
        output, proposals[passes] = decode(model, used, made)
        assert output == truth, f"{kind} {shape} through passes={passes} left plain decoding"
    assert sum(len(p.tokens) for p in proposals[True]) > 0
    assert [p.tokens.tolist() for p in proposals[True]] == [p.tokens.tolist() for p in proposals[False]]
    parents = [[None if p.parents is None else p.parents.tolist() for p in proposals[passes]]
               for passes in (True, False)]
    assert parents[0] == parents[1]
    assert (shape == "tree") == any(p is not None for p in parents[0])


@NO_CUDA
@pytest.mark.parametrize("kind", KINDS)
def test_on_cuda_captured_passes_draft_as_eager_ones_and_decode_exactly(tmp_path, monkeypatch, kind):
    model = load_model(str(save_tiny(tmp_path, seed=0)), "float32", "cuda").model
    truth = SpeculativeEngine(model).generate(SequenceSpec(PROMPT, StoppingRules.build(NEW))).token_ids
    proposals = {}
    for graphs in ("on", "off"):
        monkeypatch.setenv("VERISPEC_CUDA_GRAPHS", graphs)
        made = drafter(model, kind, False)
        output, proposals[graphs] = decode(model, made, made)
        assert output == truth, f"{kind} with CUDA graphs {graphs} left plain decoding"
        assert made.graphed.passes.failure is None
        assert bool(made.graphed.passes.captured) == (graphs == "on")
    assert sum(len(p.tokens) for p in proposals["on"]) > 0
    assert [p.tokens.tolist() for p in proposals["on"]] == [p.tokens.tolist() for p in proposals["off"]]

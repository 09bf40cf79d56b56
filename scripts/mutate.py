"""Mutation testing: plant bugs the field knows, one at a time, and show the tests kill each one.

Each mutant is an exact search/replace in one source file. The script first checks that every
search text occurs exactly once in the tree it was started from (a renamed line fails here,
loudly, instead of leaving a mutant that plants nothing), then copies the tree (tracked and
untracked, not ignored, files) into a temporary directory, never touching the working tree:

1. runs every guarding test once on the unmutated copy and requires each to pass (a test that
   fails for another reason, a missing browser, say, cannot kill anything); `--after-suite` skips
   this for the guards the default and slow suites have just passed on the same tree (.ci/run);
2. for each mutant: plants it in a copy, runs its guarding tests there (PYTHONPATH at the copy;
   pytest stops at the first failing test), restores the file. A mutant is killed only by an
   assertion failure in a named test (pytest's junit xml: a <failure> whose traceback ends in
   AssertionError); a crash of another kind, a collection or fixture error, or a timeout is
   reported but not counted. `--workers N` (default: a worker per usable core, each pytest on
   its share of the threads) runs N mutants at a time, each worker in a copy of its own.

A mutant in code this CPU never runs (`needs`: a kernel class rows.supported() lacks here), or
whose guarding tests all skip here, is "not run here", with the reason: it is neither killed nor
survived, and whoever has such a CPU runs it (`.ci/run` on an AVX2-only machine runs the AVX2
class's mutants, not the AVX-512 ones).

Prints a table (mutant, killed / SURVIVED / not counted / not run here, seconds, the tests that
killed it or why not) and exits 1 unless every mutant run here was killed. Usage (from the repository root):

    python3 scripts/mutate.py                 # every mutant, about 15 minutes on 2 cores (AVX2 EPYC)
    python3 scripts/mutate.py --only residual-from-p --only server-ignores-temperature
    python3 scripts/mutate.py --list          # the mutants and their guarding tests
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Mutant:
    """One planted bug: `search` (exactly once in `path`) becomes `replace`; `tests` guard it."""

    name: str
    path: str
    search: str
    replace: str
    tests: tuple[str, ...]
    bug: str
    env: tuple[tuple[str, str], ...] = ()  # its tests' extra environment
    needs: str = ""  # the kernel class (rows.CLASSES) without which this CPU never runs its code


DRAFTERS = "tests/test_sampling_drafters.py"
LEARNED = f"{DRAFTERS}::test_learned_drafters_sample_the_targets_distribution"
STAGED = f"{DRAFTERS}::test_staged_drafting_samples_the_targets_distribution"
SELF = f"{DRAFTERS}::test_self_speculation_samples_the_targets_distribution"
SHARED_PREFILL = "tests/test_batch.py::test_samples_share_the_prefill_and_follow_the_target_distribution"
OWN_CACHE = "tests/test_batch.py::test_samples_of_one_prompt_each_own_their_cache"
COPY_FROM = "tests/test_batch.py::test_copy_from_gives_a_cache_of_its_own"
MTP_GRADIENTS = "tests/test_hydra_mtp.py::test_mtp_head_by_head_backward_gives_the_summed_losses_gradients"
# A class's invariance cases (tests/test_invariance.py forces each class, the process's own too).
AVX2_BLOCKS = "tests/test_invariance.py::test_blocks_of_every_length_match_one_token_steps"
AVX512_BLOCKS = (f"{AVX2_BLOCKS}[tiny-int4-cpu-avx512-bf16]", f"{AVX2_BLOCKS}[tiny-bfloat16-cpu-avx512-bf16]")
# The AMX class's cases, on any CPU with AVX512-BF16: its tiles emulated (build.py).
AMX_EMULATED = (("VERISPEC_AMX_EMULATED", "1"),)
AMX_BLOCKS = (f"{AVX2_BLOCKS}[tiny-int4-cpu-amx-bf16]", f"{AVX2_BLOCKS}[tiny-bfloat16-cpu-amx-bf16]")
# The Python layer loop (the C++ one takes every Llama-kind case where the row kernels run: the
# case that runs the Python one, padded)
PYTHON_LOOP = f"{AVX2_BLOCKS}[tiny-float32-cpu-python]"
FAMILY_LOOP = ("tests/test_families.py::"
               "test_each_familys_layers_run_in_one_cpp_call_with_the_python_loops_bits")
MTP_ORDER = "tests/test_hydra_mtp.py::test_mtp_training_backpropagates_head_by_head"
EXPORT_IDS = "tests/test_eagle3.py::test_exported_aux_ids_point_the_engine_at_the_layers_the_drafter_reads"
GREEDY = "tests/test_greedy_equality.py::test_every_drafter_matches_plain_decoding[4]"
CROSS = "tests/test_cross_tokenizer.py"
CROSS_GREEDY = f"{CROSS}::test_a_draft_in_another_vocabulary_matches_plain_decoding[3]"
CROSS_SAMPLING = f"{CROSS}::test_drafting_across_tokenizers_samples_the_targets_distribution"
CROSS_TLI = (f"{CROSS_SAMPLING}[fast-tli-t1]", f"{CROSS_SAMPLING}[fast-tli-t0.7-p0.9]")
CROSS_CHAIN_END = f"{CROSS}::test_a_chain_that_ends_inside_a_target_token_proposes_whole_tokens_only"

MUTANTS = (
    Mutant("residual-from-p", "verispec/verifiers/rejection.py",
           "residual = (p_next - q_next).clamp_min(0)", "residual = p_next.clone()",
           ("tests/test_rejection_distribution.py::test_emitted_tokens_follow_target", LEARNED),
           "on rejection, resample from p instead of norm(max(0, p - q))"),
    Mutant("tree-no-residual-update", "verispec/verifiers/tree.py",
           "p = residual(p, q)", "p = p",
           ("tests/test_tree_sampling.py::test_multi_candidate_sampling_emits_the_target_distribution",
            f"{DRAFTERS}::test_lookahead_samples_the_targets_distribution"),
           "a later sibling is tried against the original p, not the residual after the earlier ones"),
    Mutant("eagle-argmax-reports-q", "verispec/drafters/eagle.py",
           "token = sample(q, request.generator)", "token = q.argmax(-1)",
           (f"{LEARNED}[fast-eagle]", f"{LEARNED}[fast-eagle3]"),
           "EAGLE (and EAGLE-3) draft the argmax under sampling but report the softmax q"),
    Mutant("eagle-draws-before-top-k", "verispec/drafters/eagle.py",
           "token = sample(q, request.generator)",
           "token = sample(self.head.full(logits).softmax(-1), request.generator)",
           ("tests/test_builtin_sampling.py::test_shipped_drafters_sample_the_builtin_models_distribution"
            "[fast-eagle]",),
           "EAGLE draws from its unwarped softmax but reports the top-k-warped q (the tiny targets' "
           "chain tests sample without top-k: only the built-in model's test, at top-k 4, sees it)"),
    Mutant("drafting-drops-the-bias", "verispec/drafters/learned.py",
           "return out if self.bias is None else out + self.bias.detach().to(out.dtype)", "return out",
           ("tests/test_learned_drafters.py::test_drafters_draft_in_8_bits_where_the_row_kernels_run",),
           "a drafter's 8-bit linear layer forgets its bias (EAGLE's fuse has one)"),
    Mutant("drafting-scales-off-the-grid", "verispec/drafters/learned.py",
           "Int8Groups.quantize(weight.detach(), DRAFT_GROUP)",
           "Int8Groups.quantize(weight.detach() * 1.001, DRAFT_GROUP)",
           ("tests/test_learned_drafters.py::test_drafters_draft_in_8_bits_where_the_row_kernels_run",),
           "a drafter's 8-bit products multiply by other weights than its own"),
    Mutant("eagle-loop-rotates-backwards", "verispec/drafters/nn.py",
           "torch.cat([-sin, sin], -1)", "torch.cat([sin, -sin], -1)",
           ("tests/test_learned_drafters.py::test_eagles_layer_runs_in_the_row_kernels_layer_loop",),
           "EAGLE's layer in rows.cpp's loop rotates its keys and queries the other way"),
    Mutant("eagle-loop-ignores-the-tree-mask", "verispec/drafters/eagle.py",
           "[cos], [sin], start, [mask], [],", "[cos], [sin], start, [None], [],",
           ("tests/test_learned_drafters.py::test_eagles_layer_runs_in_the_row_kernels_layer_loop",),
           "EAGLE's layer in rows.cpp's loop lets a tree's nodes see each other (causal rows)"),
    Mutant("eagle3-loop-swaps-its-two-inputs", "verispec/drafters/eagle3.py",
           "torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(feature)], -1)",
           "torch.cat([layer.hidden_norm(feature), layer.input_layernorm(embeds)], -1)",
           ("tests/test_learned_drafters.py::test_eagles_layer_runs_in_the_row_kernels_layer_loop",),
           "EAGLE-3's layer in rows.cpp's loop reads its feature where its embedding belongs"),
    Mutant("eagle3-loop-ignores-its-rotary-base", "verispec/drafters/eagle3.py",
           "NativeLayer(stack, attn.kv_heads, attn.head_dim, attn.theta, inputs)",
           "NativeLayer(stack, attn.kv_heads, attn.head_dim, 10000.0, inputs)",
           ("tests/test_learned_drafters.py::test_eagles_layer_runs_in_the_row_kernels_layer_loop",),
           "EAGLE-3's layer in rows.cpp's loop rotates by verispec's own base, not its target's"),
    Mutant("shape-prices-a-tree-as-a-chain", "verispec/methods.py",
           "    rows = 1 + (depth if shape.tree is None else shape.tree.nodes)",
           "    rows = 1 + depth",
           ("tests/test_builtin.py::test_eagles_shape_is_chosen_by_this_machines_profile",),
           "eagle's shape choice verifies a tree's nodes at a chain's price (a tree where rows are dear)"),
    Mutant("shape-ignores-its-depth", "verispec/methods.py",
           "    depth = METHODS[kind].default_k if shape.k is None else shape.k",
           "    depth = METHODS[kind].default_k",
           ("tests/test_builtin.py::test_eagles_shape_is_chosen_by_this_machines_profile",),
           "eagle's shape choice prices a one-token chain as two tokens (not chosen where rows are dear)"),
    Mutant("lookup-then-model-never-asks-the-model", "verispec/drafters/hybrid.py",
           "        if proposal.tokens.numel() > 0:", "        if True:",
           ("tests/test_sampling_drafters.py::test_eagle_behind_a_lookup_samples_the_targets_distribution",),
           "eagle-pld / eagle-suffix propose the lookup's draft, empty or not: EAGLE never drafts"),
    Mutant("bench-fixes-each-methods-k", "verispec/bench/runner.py",
           "        ks = config.ks if config.ks and method != AR else [None]",
           "        ks = [None] if method == AR else (config.ks or [spec.default_k])",
           ("tests/test_bench.py::test_the_bench_runs_each_method_as_it_runs_by_default",),
           "the bench runs every method at a fixed k, not as it runs by default (no profile-chosen shape)"),
    Mutant("hydra-argmax-reports-q", "verispec/drafters/hydra.py",
           "token = sample(q, request.generator)", "token = q.argmax(-1)",
           (f"{LEARNED}[fast-hydra]",),
           "Hydra drafts the argmax under sampling but reports the softmax q"),
    Mutant("mtp-argmax-reports-q", "verispec/drafters/medusa.py",
           "return Proposal(sample(q, request.generator), q)", "return Proposal(q.argmax(-1), q)",
           (f"{LEARNED}[fast-mtp]", f"{LEARNED}[fast-block]"),
           "MTP and the block drafter (Medusa's drafting) take each head's (slot's) argmax but "
           "report the softmax q"),
    Mutant("block-slots-one-position-on", "verispec/drafters/block.py",
           "positions = torch.arange(n, n + 1 + k, device=device)",
           "positions = torch.arange(n + 1, n + 2 + k, device=device)",
           ("tests/test_learned_drafters.py::test_block_drafter_drafts_with_the_slots_training_scores",),
           "the block drafter drafts its block one position later than training placed it"),
    Mutant("block-drafts-one-slot", "verispec/drafters/block.py",
           "return self.net.norm(x[0, 1:])", "return self.net.norm(x[0, 1:2])",
           (f"{LEARNED}[fast-block]",),
           "the block drafter drafts only its first slot (the sampling test then sees no drafts "
           "at the second position)"),
    Mutant("draft-model-argmax-reports-q", "verispec/drafters/model.py",
           "return [sample(q, request.generator)], [q]", "return [q.argmax(-1)], [q]",
           (SELF, SHARED_PREFILL),
           "a draft model (self-speculation here) drafts the argmax but reports the softmax q"),
    Mutant("warp-p-not-q", "verispec/drafters/model.py",
           "return [sample(q, request.generator)], [q]",
           "return [sample(q, request.generator)], [logits.float().softmax(-1)]",
           (SELF, f"{DRAFTERS}::test_a_draft_model_samples_the_targets_distribution"),
           "the draft is drawn from the warped q but q is reported before temperature / top-p"),
    Mutant("warp-q-not-p", "verispec/verifiers/rejection.py",
           "target_probs = warp_probs(target_logits, sampling)",
           "target_probs = target_logits.float().softmax(-1)",
           (SELF, f"{STAGED}[fast-t0.6]"),
           "the verifier's p is the target's softmax before temperature / top-p"),
    Mutant("staged-guess-without-coin", "verispec/drafters/model.py",
           "if torch.rand((), generator=request.generator, device=q.device) < q[i, guess]:",
           "if q[i, guess] > 0:",
           (STAGED,),
           "staged drafting keeps a lookup guess x whenever q(x) > 0, without the q(x) coin"),
    Mutant("kv-not-rewound", "verispec/model/cached_model.py",
           "            self.rewind(start + len(rows))\n            return", "            return",
           (GREEDY, "tests/test_greedy_equality.py::test_models_off_the_lean_path_match_plain_decoding[4]",
            "tests/test_greedy_equality.py::test_kv_cache_stays_consistent_over_many_rejection_cycles"),
           "the target's KV cache keeps the rejected draft tokens"),
    Mutant("samples-share-hf-cache", "verispec/model/cached_model.py",
           "self.cache = copy.deepcopy(other.cache)", "self.cache = other.cache",
           (OWN_CACHE, COPY_FROM),
           "samples of one prompt share one Hugging Face cache object (the non-lean path)"),
    Mutant("samples-share-lean-caches", "verispec/model/cached_model.py",
           "for mine, theirs in zip(self.lean.caches, other.lean.caches):",
           "self.lean.caches = other.lean.caches\n            for mine, theirs in zip((), ()):",
           (OWN_CACHE, SHARED_PREFILL, COPY_FROM),
           "samples of one prompt share one set of lean KV caches"),
    Mutant("bonus-skipped", "verispec/decoding/sequence.py",
           "block = [drafted_tokens[i] for i in path] + [verdict.next_token]",
           "block = [drafted_tokens[i] for i in path] + [verdict.next_token][: len(path) < len(proposal)]",
           ("tests/test_greedy_equality.py::test_every_step_adds_its_accepted_drafts_and_one_target_token",),
           "after a fully accepted draft the bonus token is not emitted"),
    Mutant("row-k-leaks", "verispec/decoding/sequence.py",
           "self.policy = copy.deepcopy(speculation.policy)", "self.policy = speculation.policy",
           ("tests/test_batch.py::test_each_row_adapts_its_own_draft_length",),
           "rows of a batch share one draft-length policy: a row's k leaks into the others"),
    Mutant("export-ids-sglang-unshifted", "verispec/export/eagle3.py",
           "[a - 1 for a in aux]", "[a for a in aux]",
           (EXPORT_IDS,),
           "SGLang's explicit aux ids written as Hugging Face indices (SGLang adds one)"),
    Mutant("export-ids-vllm-off-by-one", "verispec/export/eagle3.py",
           '"eagle_aux_hidden_state_layer_ids": aux,',
           '"eagle_aux_hidden_state_layer_ids": [a - 1 for a in aux],',
           (EXPORT_IDS,),
           "vLLM's aux ids written shifted as SGLang's (vLLM reads them as they are)"),
    Mutant("mtp-joint-backward", "verispec/training/losses.py",
           "    if sequential:", "    if False:",
           (MTP_ORDER,),
           "MTP's head-by-head backward replaced by the joint one (all heads' graphs alive at once)"),
    Mutant("mtp-recipe-joint-backward", "verispec/training/kinds/mtp.py",
           "multi_head_backward(b.hidden, losses)", "multi_head_backward(b.hidden, losses, False)",
           (MTP_ORDER,),
           "MTP training calls the joint backward"),
    Mutant("mtp-no-trunk-backward", "verispec/training/losses.py",
           "        trunk_out.backward(leaf.grad)", "        pass",
           (MTP_GRADIENTS,),
           "the heads' summed gradient never flows into a trainable trunk"),
    Mutant("fused-kl-gradient-without-teacher", "verispec/training/losses.py",
           ".sub_(p).mul_(grad[:, None])", ".mul_(grad[:, None])",
           ("tests/test_losses.py",),
           "the fused forward KL's gradient softmax(z) without - p: every drafter trains toward nothing"),
    Mutant("head-distillation-blocks-unscaled", "verispec/training/losses.py",
           "return grad * grad_losses[:, None].to(grad.dtype), None",
           "return grad, None",
           ("tests/test_losses.py",),
           "the block-wise head loss ignores the weight the kind puts on it (EAGLE's 0.1)"),
    Mutant("server-ignores-temperature", "verispec/server/requests.py",
           "SamplingParams.of(body.temperature, body.top_k, body.top_p)",
           "SamplingParams.of(body.temperature, body.top_k, body.top_p, do_sample=False)",
           ("tests/test_serve_sampling.py",),
           "the server decodes greedily whatever temperature the request gives"),
    Mutant("server-ignores-seed", "verispec/server/requests.py",
           "seed=body.seed, sequences=body.n", "seed=None, sequences=body.n",
           ("tests/test_serve_sampling.py",),
           "the server drops the request's seed"),
    Mutant("grammar-q-not-renormalized", "verispec/core/grammar.py",
           "kept / kept.sum(-1, keepdim=True)", "draft_probs[:legal] + 0 * kept.sum(-1, keepdim=True)",
           ("tests/test_grammar.py::test_a_cut_draft_is_verified_against_q_renormalized_over_the_grammar",),
           "a draft cut to the grammar is verified against the drafter's raw q, not q masked and "
           "renormalized over the allowed tokens"),
    Mutant("grammar-drafts-unmasked", "verispec/decoding/constrained.py",
           "masked = apply_masks(target_logits, self.state.masks.to(target_logits.device))",
           "masked = target_logits",
           ("tests/test_grammar.py::test_constrained_speculation_equals_masked_plain_decoding",),
           "the verifier scores drafts against the target's unmasked logits"),
    Mutant("cross-tli-q-not-renormalized", "verispec/drafters/cross.py",
           "0, self.shared_target, q_shared)",
           "0, self.shared_target, warp_probs(logits, request.sampling)[self.shared_draft])",
           CROSS_TLI,
           "token-level intersection draws from q over the shared tokens, renormalized, but reports "
           "the draft's whole-vocabulary q restricted to them"),
    Mutant("cross-tli-q-untempered", "verispec/drafters/cross.py",
           "0, self.shared_target, q_shared)", "0, self.shared_target, shared.softmax(-1))",
           (f"{CROSS}::test_token_level_intersection_draws_from_the_q_it_reports",),
           "token-level intersection draws from its warped law (temperature, top-p) but reports "
           "the untempered one: the end-to-end sampling test misses it at 3000 samples"),
    Mutant("cross-tli-ids-shifted", "verispec/drafters/cross.py",
           "0, self.shared_target, q_shared)", "0, self.shared_target.roll(1), q_shared)",
           CROSS_TLI,
           "the q reported over the target's ids is put on the wrong ids (a broken mapping)"),
    Mutant("cross-string-reports-uniform-q", "verispec/drafters/cross.py",
           "foreign_tokens=len(draft.tokens), boundary_lost=lost)",
           "torch.full((len(tokens), self.vocab_size), 1 / self.vocab_size), "
           "foreign_tokens=len(draft.tokens), boundary_lost=lost)",
           (f"{CROSS_SAMPLING}[fast-string-t0.8]",),
           "string match under sampling reports a q other than one-hot on its (deterministic) guess"),
    Mutant("cross-merge-across-boundary", "verispec/drafters/cross.py",
           "if found is not None and found[0][: len(window)] == window:", "if found is not None:",
           (f"{CROSS}::test_a_merge_across_the_committed_boundary_is_not_proposed",),
           "the draft's text tokenized with the committed tokens is taken even where it merges "
           "with them: tokens are skipped or repeated"),
    Mutant("cross-proposes-unfinished-token", "verispec/drafters/cross.py",
           "limit = len(draft.text) if final else", "limit = len(draft.text) if True else",
           (CROSS_GREEDY, CROSS_CHAIN_END),
           "the target token under the draft's last token is proposed though it may still grow"),
    Mutant("cross-partial-character-dropped", "verispec/drafters/cross.py",
           "self._held = spelled[whole:]", "self._held = b\"\"",
           (f"{CROSS}::test_a_character_cut_inside_by_the_committed_tokens_is_spelled_on",),
           "a committed character cut inside is forgotten: the draft spells it twice"),
    Mutant("cross-draft-cache-not-rewound", "verispec/drafters/cross.py",
           "        self.lm.rewind(same)\n", "",
           (CROSS_GREEDY,),
           "the draft model's cache keeps the refused draft tokens"),
    Mutant("vocab-metaspace-unread", "verispec/drafters/vocab.py",
           'else token.replace(SPACE, " ").encode())', "else token.encode())",
           (f"{CROSS}::test_the_bridge_meets_on_text_and_maps_specials_by_name", CROSS_GREEDY),
           "SentencePiece's ▁ is read as itself, not a space: the vocabularies no longer meet"),
    Mutant("vocab-byte-level-unread", "verispec/drafters/vocab.py",
           "bytes(alphabet[c] for c in token) if", "token.encode() if",
           (f"{CROSS}::test_the_bridge_meets_on_text_and_maps_specials_by_name", CROSS_GREEDY),
           "GPT-2's byte-level alphabet is read as text (Ġ, not a space)"),
    Mutant("vocab-draft-end-unmapped", "verispec/drafters/vocab.py",
           "ends = {i: min(target_eos) for i in draft_eos} if target_eos else {}", "ends = {}",
           (CROSS_CHAIN_END,),
           "the draft's end of text is not the target's"),
    Mutant("grammar-mask-one-row-late", "verispec/core/grammar.py",
           "self._fill(bitmask, i + 1)", "self._fill(bitmask, i)",
           ("tests/test_grammar.py::test_constrained_speculation_equals_masked_plain_decoding",),
           "a draft row is masked by its parent's grammar state instead of its own"),
    # The row kernels (verispec/model/kernels): a C++ mutant is built anew (about a minute).
    Mutant("row-kernel-lone-row-order", "verispec/model/kernels/rows.cpp",
           "          a = _mm512_fmadd_ps(sum, s, a);\n          if constexpr (MINS) a = ",
           "          if (MINS && rows == 1) a = _mm512_fmadd_ps(_mm512_set1_ps(xsum[(r0 + r) * groups + g])"
           ", m, a);\n          a = _mm512_fmadd_ps(sum, s, a);\n          if (MINS && rows > 1) a = ",
           ("tests/test_row_kernels.py::test_products_give_each_row_its_own_bits",
            *AVX512_BLOCKS),
           "a lone row adds its group's minimum term before the codes' sum, a block after",
           needs="avx512-bf16"),
    Mutant("row-attention-block-scale", "verispec/model/kernels/rows.cpp",
           "                 static_cast<float>(scale), scores.data(), os);",
           "                 n > 1 ? std::nextafter(static_cast<float>(scale), 1.0f)"
           " : static_cast<float>(scale), scores.data(), os);",
           ("tests/test_row_kernels.py::test_attention_rows_match_one_query_each",
            *AVX512_BLOCKS),
           "a block's rows attend with a scale one ulp off a one-token step's", needs="avx512-bf16"),
    Mutant("row-attention-heads-by-their-block", "verispec/model/kernels/rows.cpp",
           "  const __m512 scaling = _mm512_set1_ps(scale);",
           "  const __m512 scaling = _mm512_set1_ps(GB < 3 ? std::nextafter(scale, 1.0f) : scale);",
           ("tests/test_row_kernels.py::test_attention_rows_do_not_depend_on_how_the_threads_cut_the_heads"
            "[float32-9-3-avx512-bf16]",),
           "a head attended in a block of fewer than three heads (a kv head's heads split between "
           "threads) uses a scale one ulp off", needs="avx512-bf16"),
    Mutant("row-kernel-avx2-first-row-unfused", "verispec/model/kernels/rows.cpp",
           "  __m256 a0 = _mm256_fmadd_ps(lo, s0, _mm256_load_ps(a)), ",
           "  __m256 a0 = at == 0 ? _mm256_add_ps(_mm256_mul_ps(lo, s0), _mm256_load_ps(a))"
           " : _mm256_fmadd_ps(lo, s0, _mm256_load_ps(a)), ",
           ("tests/test_row_kernels.py::test_products_give_each_row_its_own_bits",
            f"{AVX2_BLOCKS}[tiny-int4-cpu-avx2]", f"{AVX2_BLOCKS}[tiny-bfloat16-cpu-avx2]"),
           "the AVX2 class rounds a block's first row's scaled sum apart from its add (the rest: one FMA)",
           needs="avx2"),
    Mutant("row-kernel-avx2-four-rows-even-first", "verispec/model/kernels/rows.cpp",
           "        a[r][0] = _mm256_fmadd_ps(w2, x1, a[r][0]);\n"
           "        a[r][1] = _mm256_fmadd_ps(w3, x1, a[r][1]);\n"
           "        a[r][0] = _mm256_fmadd_ps(w0, x0, a[r][0]);\n",
           "        a[r][0] = _mm256_fmadd_ps(w0, x0, a[r][0]);\n"
           "        a[r][1] = _mm256_fmadd_ps(w3, x1, a[r][1]);\n"
           "        a[r][0] = _mm256_fmadd_ps(w2, x1, a[r][0]);\n",
           ("tests/test_row_kernels.py::test_products_give_each_row_its_own_bits",
            f"{AVX2_BLOCKS}[tiny-int4-cpu-avx2]", f"{AVX2_BLOCKS}[tiny-bfloat16-cpu-avx2]"),
           "the AVX2 class's four-row blocks add a pair's even product first (a lone row: odd first)",
           needs="avx2"),
    Mutant("row-kernel-avx2-lone-row-codes-summed-apart", "verispec/model/kernels/rows.cpp",
           "  sum_chains_avx2(c, lo, hi);\n}\n\n// A lone row's dot_rows_avx2 straight from a bfloat16",
           "  lo = _mm256_add_ps(_mm256_add_ps(c[0][0], c[2][0]), _mm256_add_ps(c[1][0], c[3][0]));\n"
           "  hi = _mm256_add_ps(_mm256_add_ps(c[0][1], c[2][1]), _mm256_add_ps(c[1][1], c[3][1]));\n"
           "}\n\n// A lone row's dot_rows_avx2 straight from a bfloat16",
           ("tests/test_row_kernels.py::test_products_give_each_row_its_own_bits",
            f"{AVX2_BLOCKS}[tiny-int4-cpu-avx2]"),
           "the AVX2 class's lone row, multiplied straight from the codes, sums its four chains in "
           "another order than a block's rows", needs="avx2"),
    Mutant("row-kernel-avx2-two-rows-even-first", "verispec/model/kernels/rows.cpp",
           "          pair_step_avx2(a[e][1], e0lo, e0hi, e1lo, e1hi, x1 + 2 * (i + e));\n"
           "        }\n      }\n    }\n",
           "          const __m256 y0 = _mm256_broadcast_ss(x1 + 2 * (i + e));\n"
           "          const __m256 y1 = _mm256_broadcast_ss(x1 + 2 * (i + e) + 1);\n"
           "          a[e][1][0] = _mm256_fmadd_ps(e1lo, y1, _mm256_fmadd_ps(e0lo, y0, a[e][1][0]));\n"
           "          a[e][1][1] = _mm256_fmadd_ps(e1hi, y1, _mm256_fmadd_ps(e0hi, y0, a[e][1][1]));\n"
           "        }\n      }\n    }\n",
           ("tests/test_row_kernels.py::test_products_give_each_row_its_own_bits",
            f"{AVX2_BLOCKS}[tiny-int4-cpu-avx2]"),
           "the AVX2 class's two-row blocks add the second row's even product first (a lone row: odd first)",
           needs="avx2"),
    Mutant("row-attention-avx2-block-scale", "verispec/model/kernels/rows.cpp",
           "                              static_cast<float>(scale), scores.data(), os[b]);",
           "                              n > 1 ? std::nextafter(static_cast<float>(scale), 1.0f)"
           " : static_cast<float>(scale), scores.data(), os[b]);",
           ("tests/test_row_kernels.py::test_attention_rows_match_one_query_each",
            f"{AVX2_BLOCKS}[tiny-int4-cpu-avx2]", f"{AVX2_BLOCKS}[tiny-bfloat16-cpu-avx2]"),
           "the AVX2 class's block rows attend with a scale one ulp off a one-token step's", needs="avx2"),
    Mutant("row-kernel-amx-lone-row-order", "verispec/model/kernels/rows.cpp",
           "        __m512 a = _mm512_fmadd_ps(_mm512_load_ps(sums + (i * 16 + r) * TILE), s, "
           "_mm512_load_ps(a_at));\n"
           "        if constexpr (MINS) a = ",
           "        __m512 a = _mm512_load_ps(a_at);\n"
           "        if (MINS && rows == 1) a = "
           "_mm512_fmadd_ps(_mm512_set1_ps(xsum[(r0 + r) * groups + g]), m, a);\n"
           "        a = _mm512_fmadd_ps(_mm512_load_ps(sums + (i * 16 + r) * TILE), s, a);\n"
           "        if (MINS && rows > 1) a = ",
           ("tests/test_row_kernels.py::test_products_give_each_row_its_own_bits", *AMX_BLOCKS),
           "the AMX class: a tile holding one row adds its group's minimum term first, a fuller one last",
           AMX_EMULATED, needs="avx512-bf16"),  # the emulated tiles are AVX-512 code
    Mutant("row-kernel-amx-third-tile-second-weights", "verispec/model/kernels/rows.cpp",
           "      TILE_DPBF16PS(2, 3, 6);", "      TILE_DPBF16PS(2, 3, 5);",
           ("tests/test_row_kernels.py::test_products_take_every_count_of_output_tiles[32-amx-bf16]",),
           "the AMX class's third output tile of a group multiplies the second's weights",
           AMX_EMULATED, needs="avx512-bf16"),
    Mutant("row-kernel-amx-two-tiles-left-undone", "verispec/model/kernels/rows.cpp",
           "    if (t1 - t == 2)\n", "    if (t1 - t == 2 && M < 0)\n",
           ("tests/test_row_kernels.py::test_products_take_every_count_of_output_tiles[32-amx-bf16]",),
           "the AMX class leaves a thread's last two output tiles uncomputed", AMX_EMULATED,
           needs="avx512-bf16"),
    Mutant("row-kernel-amx-dense-tiles-not-zeroed", "verispec/model/kernels/rows.cpp",
           "      TILE_ZERO(0);\n      for (int64_t c = 0; c < chunks; ++c) {",
           "      for (int64_t c = 0; c < chunks; ++c) {",
           ("tests/test_row_kernels.py::test_products_compute_the_weights_they_stand_for",
            "tests/test_row_kernels.py::test_products_give_each_row_its_own_bits", *AMX_BLOCKS),
           "the AMX class's dense product starts a tile of rows from the previous tile's sums",
           AMX_EMULATED, needs="avx512-bf16"),  # the emulated tiles are AVX-512 code
    Mutant("row-attention-amx-wide-tile-scale", "verispec/model/kernels/rows.cpp",
           "index.data(), count, a.scale, scores.data() + b * padded);",
           "index.data(), count, u1 - u0 > 3 ? std::nextafter(a.scale, 1.0f) : a.scale, "
           "scores.data() + b * padded);",
           ("tests/test_row_kernels.py::test_attention_rows_match_one_query_each[64-dtype1-amx-bf16]",),
           "the AMX class's bfloat16 attention scales the scores of a tile holding more than one row's "
           "heads one ulp off a one-token step's", AMX_EMULATED, needs="avx512-bf16"),
    Mutant("row-attention-amx-reads-a-neighbours-scores", "verispec/model/kernels/rows.cpp",
           "gather_scores(S.data() + (g0 + b - u0) * (padded + 16)",
           "gather_scores(S.data() + ((g0 + b - u0) ^ 1) * (padded + 16)",
           ("tests/test_row_kernels.py::test_attention_rows_match_one_query_each[128-dtype1-amx-bf16]",),
           "the AMX class's bfloat16 attention reads another query's scores", AMX_EMULATED,
           needs="avx512-bf16"),
    Mutant("build-waits-on-a-killed-builds-lock", "verispec/model/kernels/build.py",
           '        (directory / "lock").unlink(missing_ok=True)\n', "",
           ("tests/test_kernel_build.py::test_a_lock_left_by_a_killed_build_is_cleared_and_the_library_built",),
           "a build stopped midway leaves torch's lock file, and every later build of that source hangs"),
    Mutant("row-norm-lone-row-order", "verispec/model/kernels/rows.cpp",
           "    for (int width = 8; width >= 1; width /= 2)",
           "    if (r1 - r0 == 1) std::swap(lanes[0], lanes[15]);\n"
           "    for (int width = 8; width >= 1; width /= 2)",
           ("tests/test_row_kernels.py::test_the_norm_gives_each_row_its_own_bits_and_the_rms_norm",),
           "the norm sums a lone row's squares in another order than a block's"),
    Mutant("row-layer-loop-never-pads", "verispec/model/kernels/rows.cpp",
           "  const at::Tensor in = n >= least ? x : at::cat",
           "  const at::Tensor in = true ? x : at::cat",
           ("tests/test_row_kernels.py::"
            "test_the_float32_layer_loop_pads_a_lone_row_where_a_product_rounds_one_apart",),
           "the layer loop multiplies a one-token step's lone row where an invariant pass pads it"),
    Mutant("greedy-keeps-a-draft-past-its-first-miss", "verispec/verifiers/greedy.py",
           "    while num_accepted < k and drafted[num_accepted] == best[num_accepted]:\n"
           "        num_accepted += 1",
           "    num_accepted = sum(a == b for a, b in zip(drafted, best))",
           ("tests/test_argmax.py::test_the_greedy_verifiers_keep_the_first_of_tied_tokens",
            "tests/test_greedy_equality.py"),
           "the greedy chain verifier counts every matching draft token, not the leading run"),
    Mutant("argmax-last-of-ties", "verispec/core/argmax.py",
           "np.asarray(np.argmax(logits.numpy(), axis=-1), dtype=np.int64)",
           "np.asarray(logits.shape[-1] - 1 - np.argmax(logits.numpy()[..., ::-1], axis=-1), dtype=np.int64)",
           ("tests/test_argmax.py",),
           "the fast argmax takes the last of tied largest logits, where torch takes the first"),
    Mutant("module-norm-weight-before-the-cast", "verispec/model/kernels/rows.cpp",
           "  return gemma ? (n * weight).to(x.scalar_type()) : weight * n.to(x.scalar_type());",
           "  return gemma ? (n * weight).to(x.scalar_type()) : (weight * n).to(x.scalar_type());",
           ("tests/test_row_kernels.py::test_a_module_norm_gives_the_modules_own_bits",),
           "a float target's Llama-kind norm multiplies its weight before the cast back, not after"),
    Mutant("module-norm-drops-gemmas-one", "verispec/model/lean.py",
           "self.weight = 1.0 + weight.float() if self.gemma else weight",
           "self.weight = weight.float() if self.gemma else weight",
           ("tests/test_row_kernels.py::test_a_module_norm_gives_the_modules_own_bits",),
           "Gemma 3's norm scales by its stored weight, not 1 + it"),
    Mutant("row-rotate-one-rounding", "verispec/model/kernels/rows.cpp",
           "    const T straight = v[d] * c[d];",
           "    const float straight = static_cast<float>(v[d]) * static_cast<float>(c[d]);",
           ("tests/test_row_kernels.py::test_rotate_gives_the_bits_of_the_four_torch_ops",),
           "the C++ rotary keeps a bfloat16 product in float32 where torch's op rounds it"),
    Mutant("row-cache-block-reversed", "verispec/model/kernels/rows.cpp",
           "      const int64_t slot = (h * capacity + length + r) * D;",
           "      const int64_t slot = (h * capacity + length + (n - 1 - r)) * D;",
           ("tests/test_row_kernels.py::test_heads_into_cache_gives_the_queries_and_cache_of_the_ops_it_replaces",
            "tests/test_invariance.py::test_blocks_of_every_length_match_one_token_steps"),
           "a block's keys and values land in the cache in reverse order (a one-token step's are right)"),
    Mutant("row-layer-loop-skips-qk-norms", "verispec/model/kernels/rows.cpp",
           "      if (layer.q_norm.defined()) qkv = norm_heads(qkv, layer, k.size(1), k.size(3));",
           "",
           (f"{FAMILY_LOOP}[qwen3-bfloat16]",),
           "the C++ layer loop rotates Qwen3's queries and keys without their per-head norms"),
    Mutant("row-layer-loop-ignores-the-window", "verispec/model/kernels/rows.cpp",
           "attention(q, k, v, mask, length, scale, isa, masked ? 0 : layer.window)",
           "attention(q, k, v, mask, length, scale, isa, 0)",
           (f"{FAMILY_LOOP}[mistral-float32]",),
           "the C++ layer loop's chain rows attend past their sliding window"),
    Mutant("row-layer-loop-one-mask-for-every-window", "verispec/model/lean.py",
           "[sights[window][0].rows for window in self.windows]",
           "[sights[self.windows[0]][0].rows for window in self.windows]",
           (f"{FAMILY_LOOP}[gemma3-float32]",),
           "a tree's global layers in the C++ loop see through the sliding layers' mask"),
    Mutant("row-layer-loop-drops-the-sandwich-norm", "verispec/model/kernels/rows.cpp",
           "maybe_norm(multiply(layer.out, attended, least[1]), layer.attn_post_norm)",
           "multiply(layer.out, attended, least[1])",
           (f"{FAMILY_LOOP}[gemma3-int4]",),
           "the C++ layer loop adds Gemma 3's attention output without its post-attention norm"),
    Mutant("row-layer-loop-exact-gelu", "verispec/model/kernels/rows.cpp",
           'at::gelu(gate_up[0], "tanh")',
           "at::gelu(gate_up[0])",
           (f"{FAMILY_LOOP}[gemma3-float32]",),
           "the C++ layer loop gates Gemma 3's MLP by the exact GELU, not its tanh form"),
    Mutant("row-layer-loop-one-rotary-table", "verispec/model/kernels/rows.cpp",
           "heads_into_cache(qkv, cos[layer.kind], signed_sin[layer.kind], k, v, start, heads)",
           "heads_into_cache(qkv, cos[0], signed_sin[0], k, v, start, heads)",
           (f"{FAMILY_LOOP}[gemma3-bfloat16]",),
           "the C++ layer loop rotates Gemma 3's global layers by its local layers' table"),
    Mutant("row-layer-loop-mlp-reads-attention-norm", "verispec/model/kernels/rows.cpp",
           "multiply(layer.gate_up, norm(x, layer.mlp_norm), least[2])",
           "multiply(layer.gate_up, norm(x, layer.attn_norm), least[2])",
           ("tests/test_row_kernels.py::test_the_layer_loop_in_cpp_gives_the_python_loops_bits",),
           "the C++ layer loop normalises the MLP's input with the attention's norm weights"),
    Mutant("row-layer-loop-module-norm-squares-in-bfloat16", "verispec/model/kernels/rows.cpp",
           "at::rsqrt(h.pow(2).mean(-1, true) + eps)",
           "at::rsqrt(x.pow(2).to(at::kFloat).mean(-1, true) + eps)",
           ("tests/test_row_kernels.py::test_a_module_norm_gives_the_modules_own_bits",),
           "the C++ spelling of an RMSNorm module squares a bfloat16 row before widening it"),
    Mutant("rotary-sign-on-the-wrong-half", "verispec/model/lean.py",
           "torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)",
           "torch.cat([sin[:, :half], -sin[:, half:]], dim=-1)",
           ("tests/test_cached_model.py::test_lean_path_gives_the_models_own_logits",),
           "the lean forward's rotation folds rotate_half's sign into the wrong half of sin"),
    Mutant("row-attention-only-for-blocks", "verispec/model/lean.py",
           "                if invariant and not seen.whole and w.row_kernel_attention:",
           "                if invariant and not seen.whole and w.row_kernel_attention and n > 1:",
           (PYTHON_LOOP,),
           "one-token steps attend through SDPA while blocks use the row kernel's attention"),
    Mutant("row-attention-ignores-the-window", "verispec/model/lean.py",
           "window=None if seen.rows is not None else layer.window))",
           "window=None))",
           ("tests/test_families.py::test_windowed_layers_attend_through_the_row_kernel[gemma3-float32]",),
           "a sliding-window layer's chain rows attend over every cached key through the row kernel"),
    Mutant("padded-rows-kept-instead-of-the-rows", "verispec/model/lean.py",
           "            return f(pad_rows(h, w.min_rows[role]))[:, :n]",
           "            return f(pad_rows(h, w.min_rows[role]))[:, -n:]",
           (PYTHON_LOOP,),
           "a pass of fewer rows than a product's least keeps the padding's outputs, not its own rows"),
    Mutant("wide-rows-chosen-where-slower", "verispec/model/lean.py",
           "fastest_wide <= WIDE_MARGIN * fastest_narrow", "fastest_narrow <= WIDE_MARGIN * fastest_wide",
           ("tests/test_invariance.py::test_few_rows_are_padded_wide_only_where_that_is_timed_faster",),
           "few rows are padded to WIDE_ROWS where that streams slower, not faster"),
    Mutant("profile-cached-beside-a-steady-load", "verispec/profile.py",
           "    elif crowded(others, profile):", "    elif False:",
           ("tests/test_auto.py::test_a_profile_measured_beside_a_steady_load_is_not_cached",),
           "a profile measured while other processes kept the cores busy is cached as this machine's"),
    Mutant("profile-keeps-a-dip-in-the-forwards-timings", "verispec/profile.py",
           "    forward = non_decreasing([statistics.median(times[rows]) for rows in times])",
           "    forward = tuple(statistics.median(times[rows]) for rows in times)",
           ("tests/test_auto.py::test_a_dip_in_the_forwards_timings_is_not_taken_for_a_cheaper_width",),
           "a noisy dip in T(rows) is kept, and auto drafts to the width it makes look cheap"),
    Mutant("profile-measured-by-two-at-once", "verispec/profile.py",
           "        with held(path.with_suffix(\".lock\"),",
           "        with held(path.with_suffix(f\".{id(lm)}.lock\"),",  # a lock of each caller's own
           ("tests/test_auto.py::test_two_processes_wanting_one_profile_measure_it_once",),
           "two processes wanting one profile both measure it, each beside the other's load"),
    Mutant("others-load-read-from-the-hosts-cpus-under-a-quota", "verispec/core/cores.py",
           "if quota and quota[0] < len(cpus):", "if False:",
           ("tests/test_cores.py::test_under_a_quota_the_others_load_is_the_cgroups_time_and_an_impossible_reading_is_none",),
           "in a container under a CPU quota, every tenant of the host counts as load beside the profile"),
    Mutant("auto-cuts-lookup-offers-short", "verispec/drafters/auto.py",
           "for k in (limit,) if name in whole or name in trees else range(1, limit + 1):",
           "for k in (limit,) if name in trees else range(1, limit + 1):",
           ("tests/test_auto.py::test_an_offer_drafted_whole_or_not_at_all",),
           "auto cuts a lookup's offer to the k its counts favour (the rule that lost to suffix alone)"),
    Mutant("auto-prices-a-tree-as-a-chain", "verispec/drafters/auto.py",
           "rows, drafted = (1 + trees[name], TREE_LEVEL * k) if name in trees else (k + 1, k)",
           "rows, drafted = (k + 1, TREE_LEVEL * k) if name in trees else (k + 1, k)",
           ("tests/test_auto.py::test_a_tree_is_priced_by_its_nodes_rows_and_drafted_whole_to_its_depth",),
           "auto prices a tree's verify as a chain's of its depth (its other nodes' rows for free)"),
    Mutant("auto-judges-a-tree-by-its-nodes", "verispec/drafters/auto.py",
           "self.drafted = proposal.depth", "self.drafted = len(proposal)",
           ("tests/test_auto.py::test_a_tree_step_is_judged_a_level_at_a_time_and_timed_as_levels",),
           "auto counts a tree's every node as a drafted position: a path kept whole reads as a refusal"),
    Mutant("auto-judges-offers-early", "verispec/drafters/auto.py",
           "decided = len(draft) if kept < len(text) or len(text) == len(draft) else kept",
           "decided = len(draft)",
           ("tests/test_auto.py::test_lookups_in_order_of_preference_and_every_offer_judged_as_the_text_decides_it",),
           "auto scores a lookup's offer before the committed text has decided it (a kept tail "
           "counted as refused)"),
    Mutant("auto-prices-a-catch-up-as-pace", "verispec/drafters/auto.py",
           "            else:\n                self.slowdown[self.chosen] = (COST_DECAY",
           "            if True:\n                self.slowdown[self.chosen] = (COST_DECAY",
           ("tests/test_auto.py::test_catching_up_after_sitting_out_is_not_taken_for_the_drafters_pace",),
           "auto counts a self-drafter's catching up on a stretch it sat out as its pace"),
    Mutant("auto-charges-no-re-read", "verispec/drafters/auto.py",
           "drafts, pace, overhead,\n                             self.trees, catchup, owed)",
           "drafts, pace, overhead,\n                             self.trees, None, owed)",
           ("tests/test_auto.py::test_a_return_after_a_stretch_sat_out_is_charged_its_re_read_spread_over_the_stretch",),
           "a model drafter's return is priced without re-reading the stretch it sat out"),
    Mutant("auto-charges-a-re-read-whole", "verispec/drafters/auto.py",
           "self._behind(name, context) / self.stretch[name]", "self._behind(name, context)",
           ("tests/test_auto.py::test_a_return_after_a_stretch_sat_out_is_charged_its_re_read_spread_over_the_stretch",),
           "a return's re-read is charged whole to its step, not spread over the stretch it buys"),
    Mutant("auto-never-tries-a-drafter-priced-out", "verispec/drafters/auto.py",
           "if idle >= wait}", "if False}",
           ("tests/test_auto.py::test_a_drafter_priced_a_little_under_plain_decoding_is_tried_and_kept_where_it_pays",),
           "a model drafter priced a little under plain decoding from the first step is never judged"),
    Mutant("auto-tries-a-refused-drafter-at-a-steady-pace", "verispec/drafters/auto.py",
           "                wait *= 2\n", "                wait *= 1\n",
           ("tests/test_auto.py::test_a_drafter_priced_a_little_under_plain_decoding_is_tried_and_kept_where_it_pays",),
           "a drafter whose trials are refused is tried every EXPLORE_EVERY steps all answer long"),
    Mutant("auto-learns-its-stretch-from-trials", "verispec/drafters/auto.py",
           "if name is not None and not (trial and steps == 1):", "if name is not None:",
           ("tests/test_auto.py::test_a_drafter_priced_a_little_under_plain_decoding_is_tried_and_kept_where_it_pays",),
           "a refused trial's one-step run shortens the drafter's stretch and prices its returns out"),
    Mutant("auto-rests-by-steps", "verispec/drafters/auto.py",
           "share = 1.0 - (1.0 - self.recovery) ** tokens", "share = self.recovery",
           ("tests/test_auto.py::"
            "test_a_drafter_sitting_out_drifts_back_to_its_prior_by_the_text_that_went_by",),
           "a drafter sitting out another's long steps drifts back to its prior by steps, not tokens"),
    Mutant("auto-tries-only-against-plain-decoding", "verispec/drafters/auto.py",
           "if choice.method != chosen.method\n", "if best.method is None\n",
           ("tests/test_auto.py::test_a_drafter_priced_a_little_under_the_chosen_one_is_tried_too",),
           "a model drafter priced a little under the drafter chosen is never tried"),
    Mutant("profile-prior-pools-the-answers", "verispec/profile.py",
           "max(k / (k + r) for k, r in counts)", "min(k / (k + r) for k, r in counts)",
           ("tests/test_auto.py::"
            "test_a_drafters_prior_is_its_acceptance_in_the_best_of_several_answers",),
           "a drafter's prior is its worst answer's acceptance: set too low, it is never judged"),
    Mutant("profile-answers-run-past-the-end-of-text", "verispec/profile.py",
           "StoppingRules.build(ANSWER_TOKENS, target.eos_token_ids)", "StoppingRules.build(ANSWER_TOKENS)",
           ("tests/test_auto.py::"
            "test_a_drafters_prior_is_its_acceptance_in_the_best_of_several_answers",),
           "the profile's answers run past the model's end of text (a loop or an answer by a near-tie)"),
    Mutant("auto-never-forgives-refusals", "verispec/drafters/auto.py",
           "                self.acceptance[name].rest(priced_out=self.chosen is None, "
           "tokens=num_accepted + 1)\n", "",
           ("tests/test_auto.py::test_a_drafter_priced_out_by_refusals_comes_back_at_longer_and_longer_intervals",),
           "a model drafter priced out by a few refusals sits out the rest of the answer"),
    Mutant("auto-hands-no-hidden-states", "verispec/drafters/auto.py",
           "        self.needs_hidden = bool(readers)", "        self.needs_hidden = False",
           ("tests/test_auto.py::test_a_trained_drafter_among_autos_candidates_reads_the_targets_hidden_states",),
           "auto asks the engine for no hidden states: EAGLE among its candidates cannot draft"),
    Mutant("auto-never-forgives-a-slow-stretch", "verispec/drafters/auto.py",
           "self.slowdown[name] = 1 + (self.slowdown[name] - 1) * RECOVERY",
           "self.slowdown[name] = self.slowdown[name]",
           ("tests/test_auto.py::test_a_drafter_priced_out_by_a_stretch_of_load_comes_back",),
           "a slowdown learnt under load keeps a drafter out for the rest of the process"),
    Mutant("auto-speculates-on-a-hair", "verispec/drafters/auto.py",
           "best = replace(plain, tokens_per_second=plain.tokens_per_second * (1 + MARGIN))",
           "best = plain",
           ("tests/test_auto.py::test_a_candidate_must_beat_plain_decoding_by_the_margin",),
           "auto speculates wherever its model puts a candidate a hair above plain decoding"),
    Mutant("auto-prices-a-seeded-sequence-by-the-load", "verispec/drafters/auto.py",
           "(None, None, 0.0) if request.seeded else", "(None, None, 0.0) if False else",
           ("tests/test_auto.py::test_a_seeded_sequence_is_priced_by_the_profile_alone",
            "tests/test_auto.py::test_a_seed_pins_autos_sampled_output_whatever_the_load",
            "tests/test_auto.py::test_the_verify_is_priced_by_what_the_targets_forwards_took",
            "tests/test_auto.py::test_a_steps_overhead_is_paid_once_a_token_by_plain_decoding_and_once_a_step_by_a_draft"),
           "a seeded sequence's choices follow the slowdown, verify pace and overhead learnt from "
           "wall time: the seed no longer pins the sampled output"),
    Mutant("auto-ignores-what-forwards-took", "verispec/drafters/auto.py",
           "            self.pace.observe(rows, seconds / self.profile.forward_seconds(rows))\n",
           "            pass\n",
           ("tests/test_auto.py::test_auto_counts_one_forward_a_step_and_only_for_steps_it_proposed",),
           "auto prices every verify by the profile's T(rows), however the run's forwards differ"),
    Mutant("auto-ignores-a-steps-overhead", "verispec/drafters/auto.py",
           " * (1.0 if pace is None else pace(rows)) + overhead", " * (1.0 if pace is None else pace(rows))",
           ("tests/test_auto.py::test_a_steps_overhead_is_paid_once_a_token_by_plain_decoding_and_once_a_step_by_a_draft",),
           "auto prices a step by its forward and drafting alone, as if plain decoding paid no "
           "overhead a token"),
    Mutant("auto-seeded-answer-starts-from-earlier-answers", "verispec/drafters/auto.py",
           "Acceptance(self.priors[name] if request.seeded", "Acceptance(self.priors[name] if False",
           ("tests/test_auto.py::test_an_unseeded_answer_starts_from_the_acceptance_of_the_answers_before_it_where_higher",),
           "a seeded answer's prior follows the process's earlier answers: the seed no longer pins "
           "the sampled output"),
    Mutant("auto-unlucky-answers-price-a-drafter-out", "verispec/drafters/auto.py",
           "else max(learnt.rate, self.priors[name]))", "else learnt.rate)",
           ("tests/test_auto.py::test_an_unseeded_answer_starts_from_the_acceptance_of_the_answers_before_it_where_higher",),
           "a drafter refused in a few answers starts every later one below its profiled "
           "acceptance, and may never draft again to recover it"),
    Mutant("data-engine-windows-shortest-first", "verispec/training/data_engine.py",
           "    rng.shuffle(batches)\n", "",
           ("tests/test_data_engine.py::test_training_batches_are_cut_from_length_sorted_windows",),
           "a sorted window's batches come shortest first: a prefix of the shards (a smaller "
           "--tokens, a training curve's first point) holds only short exchanges"),
    Mutant("graphed-drafter-pass-drops-values", "verispec/drafters/graphed.py",
           "        self.values.index_copy_(2, self.passes.slots, values)\n", "",
           ("tests/test_graphed_drafters.py::test_passes_compute_what_the_network_computes",),
           "a drafter's fixed-shape pass writes its keys but not its values into the fixed cache"),
    Mutant("pass-attention-unscaled", "verispec/model/graphs.py",
           ".mul_(scale).add_(bias)", ".add_(bias)",
           ("tests/test_invariance.py::test_the_fixed_shape_passes_compute_the_models_own_logits",),
           "a fixed-shape pass's attention forgets the 1/sqrt(head_dim) scale (invariant, and wrong)"),
    Mutant("lean-refuses-bfloat16-without-onednn", "verispec/model/lean.py",
           "or on_gpu or rows_take_bfloat16(model)):", "or on_gpu):",
           ("tests/test_invariance.py::test_bfloat16_is_lean_on_the_row_kernels_where_onednn_cannot_pack_it",),
           "a bfloat16 target where oneDNN cannot pack it (AVX2) runs its own forward, not invariant"),
    Mutant("profile-caches-a-busy-machines-profile", "verispec/profile.py",
           "    if not steady(profile):\n        why =",
           "    if False:\n        why =",
           ("tests/test_auto.py::test_a_profile_measured_on_a_busy_machine_is_measured_again_and_not_cached",),
           "a profile whose repeats disagree (a busy machine's) is cached and read for good"),
    Mutant("bench-runs-draft-from-each-others-answer", "verispec/bench/runner.py",
           "            answers.append(take_outputs_since(target.model, marks))",
           "            answers.append({})",
           ("tests/test_bench.py::test_repeats_keep_the_median_and_every_round_drafts_from_the_same_outputs",
            "tests/test_bench.py::test_a_method_at_two_ks_never_drafts_the_others_answer_to_the_same_question"),
           "a run of a question drafts from the answer an earlier run (a round before, or the same "
           "method at another k) left in suffix's cache"),
    Mutant("kernel-choice-measured-every-load", "verispec/model/lowbit.py",
           "        if label in options:\n            return label",
           "        if False:\n            return label",
           ("tests/test_self_spec.py::test_the_kernel_choice_is_measured_once_per_machine",),
           "the self-drafters' kernel choice is read from the cache but never used"),
    Mutant("profile-reruns-the-drafters-while-busy", "verispec/profile.py",
           "            timed = time_forward(target, lm, prompts[0])\n            if steady(timed):",
           "            timed = time_forward(target, lm, prompts[0])\n"
           "            costs = {name: drafter_cost(target, build(), limits[name], prompts)\n"
           "                     for name, build in drafters.items()}\n            if steady(timed):",
           ("tests/test_auto.py::test_a_profile_measured_on_a_busy_machine_is_measured_again_and_not_cached",),
           "a busy machine's profile runs every drafter again with each timing of the forward"),
)


def check_searches(mutants: tuple[Mutant, ...], root: Path) -> None:
    """Exit with a list of every mutant whose search text is not exactly once in its file, or whose
    guarding test is gone (a renamed test would make the mutant survive for the wrong reason)."""
    problems = []
    for m in mutants:
        path = root / m.path
        if not path.is_file():
            problems.append(f"{m.name}: {m.path} does not exist")
            continue
        count = path.read_text().count(m.search)
        if count != 1:
            problems.append(f"{m.name}: search text found {count} times in {m.path} (must be once): "
                            f"{m.search!r}")
        for test in m.tests:
            file, _, name = test.partition("::")
            test_path = root / file
            missing = not test_path.is_file() or (
                name and f"def {name.split('[')[0]}(" not in test_path.read_text())
            if missing:
                problems.append(f"{m.name}: guarding test {test} does not exist")
    if problems:
        sys.exit("mutants out of date with the code (update MUTANTS in scripts/mutate.py):\n  "
                 + "\n  ".join(problems))


def copy_tree(root: Path, destination: Path) -> None:
    """The tracked and untracked (not ignored) files of the repository at root."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=root, check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = root / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


RUNNING: set[subprocess.Popen] = set()  # the pytest runs under way (stopped on SIGTERM)
STOPPING = threading.Event()


def stop(*_: object) -> None:
    """SIGTERM: start no more runs, stop those under way, then exit (the copies are cleaned up)."""
    STOPPING.set()
    for pytest in list(RUNNING):
        pytest.kill()
    sys.exit(143)


@dataclass
class Outcome:
    passed: set[str]
    killed_by: list[str]  # tests failing with an AssertionError
    other: list[str]  # tests failing otherwise, or errors (not counted)
    timed_out: bool
    seconds: float
    skipped: list[str] = field(default_factory=list)  # why each skipped test skipped

    @property
    def ran_nothing(self) -> bool:
        """Every guarding test skipped here (none passed or failed)."""
        return not (self.passed or self.killed_by or self.other or self.timed_out)


def run_tests(copy: Path, tests: list[str], timeout: float, extra: tuple[tuple[str, str], ...] = (),
              first_failure: bool = False, threads: int = 0) -> Outcome:
    """Run `tests` in the copy (`extra`: environment besides; `first_failure`: stop at the first
    failing test; `threads`: torch's, where not 0); what passed, what failed by an assertion, what
    failed otherwise."""
    report = copy / "mutate-junit.xml"
    report.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1", **dict(extra)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    started = time.perf_counter()
    # the guards' `slow` cases too (many sampling checks run at TV 0.1 only there), not their
    # full-power repeats
    with subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-m", "not full_power", *(["-x"] if first_failure else []),
                           f"--junitxml={report}", *tests],
                          cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as pytest:
        RUNNING.add(pytest)
        try:
            stdout, _ = pytest.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.kill()
            return Outcome(set(), [], [], True, time.perf_counter() - started)
        finally:
            RUNNING.discard(pytest)
    seconds = time.perf_counter() - started
    if pytest.returncode == 4:  # a usage error: a named test not found here, say
        said = [line for line in stdout.splitlines() if line.startswith("ERROR")][:1]
        return Outcome(set(), [], [f"pytest could not run the tests: {said[0] if said else 'usage error'}"],
                       False, seconds)
    if not report.is_file():
        return Outcome(set(), [], ["pytest wrote no report"], False, seconds)
    passed, killed_by, other, skipped = set(), [], [], []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name')}"
        failure, error = case.find("failure"), case.find("error")
        if failure is not None:
            last = [line for line in (failure.text or "").splitlines() if line.strip()][-1:]
            if last and last[0].rstrip().endswith(": AssertionError"):
                killed_by.append(name)
            else:
                other.append(f"{name} ({last[0].rsplit(': ', 1)[-1] if last else 'failure'})")
        elif error is not None:
            other.append(f"{name} (error: {(error.get('message') or '')[:60]})")
        elif case.find("skipped") is None:
            passed.add(name)
        else:
            skipped.append(case.find("skipped").get("message") or "skipped")
    return Outcome(passed, killed_by, other, False, seconds, skipped)


def kernel_classes() -> set[str]:
    """The row-kernel classes this CPU runs (rows.supported(); none where they do not build)."""
    from verispec.model.kernels.rows import supported

    return set(supported())



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", metavar="NAME", help="run only these mutants")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--check", action="store_true",
                        help="only check that each mutant's code and guarding tests still exist")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per pytest run")
    parser.add_argument("--workers", type=int, default=0,
                        help="mutants run at a time, each in a copy of its own (default: a usable core each)")
    parser.add_argument("--after-suite", action="store_true",
                        help="skip the baseline of the guards in the default environment: the default and "
                             "slow suites have just passed on this tree (.ci/run)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, stop)
    mutants = MUTANTS
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTANTS}
        if unknown:
            parser.error(f"unknown mutants {sorted(unknown)}; see --list")
        mutants = tuple(m for m in MUTANTS if m.name in args.only)
    if args.list:
        for m in mutants:
            where = f" (runs only where the CPU has {m.needs})" if m.needs else ""
            print(f"{m.name}: {m.bug}\n    {m.path}{where}\n    guarded by {', '.join(m.tests)}")
        return 0
    check_searches(mutants, ROOT)
    if args.check:
        print(f"{len(mutants)} mutants: each search text found once, each guarding test exists")
        return 0
    from verispec.core.cores import usable_cores  # a container's CPU quota, where it has one

    classes = kernel_classes()
    results = {m.name: ("not run here", f"this CPU lacks {m.needs}", 0.0)
               for m in mutants if m.needs and m.needs not in classes}
    for name, (verdict, why, _) in results.items():
        print(f"{name}: {verdict} ({why})", flush=True)
    mutants = tuple(m for m in mutants if m.name not in results)
    workers = max(1, min(args.workers or usable_cores(), len(mutants)))
    threads = max(1, usable_cores() // workers)
    with tempfile.TemporaryDirectory(prefix="verispec-mutate-") as tmp:
        copies: queue.Queue[Path] = queue.Queue()
        for worker in range(workers):
            copy_tree(ROOT, Path(tmp) / str(worker))
            copies.put(Path(tmp) / str(worker))
        for env in dict.fromkeys(m.env for m in mutants):  # one baseline per environment
            named = " ".join(f"{key}={value}" for key, value in env)
            if args.after_suite and not env:
                print("baseline: skipped (--after-suite: the suites passed on this tree)", flush=True)
                continue
            guards = list(dict.fromkeys(t for m in mutants if m.env == env for t in m.tests))
            print(f"baseline: {len(guards)} guarding test selections on the unmutated copy {named}...",
                  flush=True)
            baseline = run_tests(Path(tmp) / "0", guards, args.timeout, env)
            if baseline.timed_out or baseline.killed_by or baseline.other or not baseline.passed:
                failing = baseline.killed_by + baseline.other
                print(f"the guarding tests do not all pass on the unmutated code ({baseline.seconds:.0f} s; "
                      f"timed out: {baseline.timed_out}): {failing}", file=sys.stderr)
                return 2
            print(f"baseline: {len(baseline.passed)} tests pass ({baseline.seconds:.0f} s)\n", flush=True)

        def plant(m: Mutant) -> None:
            """Run m's guards in a free copy with m planted; its row of the table."""
            if STOPPING.is_set():
                return
            copy = copies.get()
            path = copy / m.path
            original = path.read_text()
            path.write_text(original.replace(m.search, m.replace, 1))
            try:
                outcome = run_tests(copy, list(m.tests), args.timeout, m.env, first_failure=True,
                                    threads=threads)
            finally:
                path.write_text(original)
                copies.put(copy)
            if outcome.killed_by:
                verdict, by = "killed", ", ".join(t.removeprefix("tests.") for t in outcome.killed_by)
            elif outcome.timed_out or outcome.other:
                verdict = "not counted"
                by = "timeout" if outcome.timed_out else "; ".join(outcome.other)[:100]
            elif outcome.ran_nothing:
                verdict, by = "not run here", "; ".join(dict.fromkeys(outcome.skipped))[:100]
            else:
                verdict, by = "SURVIVED", ""
            results[m.name] = (verdict, by, outcome.seconds)
            print(f"{m.name}: {verdict} {by} ({outcome.seconds:.0f} s)", flush=True)

        print(f"{len(mutants)} mutants, {workers} at a time ({threads} thread{'s' * (threads > 1)} each)",
              flush=True)
        pool = ThreadPoolExecutor(workers)
        try:
            list(pool.map(plant, mutants))
        finally:
            pool.shutdown(cancel_futures=True)
    rows = [(m.name, *results[m.name]) for m in MUTANTS if m.name in results]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'mutant'.ljust(width)}  {'result'.ljust(12)}  seconds  killed by, or why not")
    for name, verdict, by, seconds in rows:
        print(f"{name.ljust(width)}  {verdict.ljust(12)}  {seconds:7.0f}  {by}")
    killed = sum(r[1] == "killed" for r in rows)
    run = [r for r in rows if r[1] != "not run here"]
    print(f"\n{killed} of {len(run)} mutants run here killed"
          + (f"; {len(rows) - len(run)} not run here (see above)" if len(run) < len(rows) else ""))
    return 0 if killed == len(run) else 1


if __name__ == "__main__":
    sys.exit(main())

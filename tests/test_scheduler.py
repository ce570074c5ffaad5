"""The engine's scheduler: the step plan says where each sequence's rows lie in the pass's output, the token
budget reserves prompt rows, admission hands out slots oldest first, and prefill progress is computed tokens
against the prompt (no phase flag)."""

from __future__ import annotations

import pytest

from draftwise.backends.slots import LOGITS_ALL, LOGITS_LAST, LOGITS_NONE
from draftwise.config import SamplingParams
from draftwise.engine.scheduler import Scheduler, fit_rows, within_rows
from draftwise.engine.sequence import BatchSequence, RequestState
from draftwise.proposers.base import DraftProposal
from draftwise.sampling import Sampler
from draftwise.speculation.controller import AcceptanceEstimator
from draftwise.stats import SpeculativeStats


def _sequence(seq_id: int, prompt: list[int], max_k: int = 4) -> BatchSequence:
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    return BatchSequence(seq_id=seq_id, prompt=prompt, params=params, sampler=Sampler(params), scope="", max_k=max_k,
                         stop_ids=frozenset(), estimator=AcceptanceEstimator(max_k), stats=SpeculativeStats(),
                         arrival_s=0.0)


def _scheduler(slots: int = 3, budget: int = 16, min_prefill: int = 4, hidden: bool = True) -> Scheduler:
    return Scheduler(slots, budget, min_prefill, max_pieces=slots, max_context=64, needs_hidden=hidden)


def _admit_all(scheduler: Scheduler, *sequences: BatchSequence) -> list[BatchSequence]:
    for sequence in sequences:
        scheduler.add(sequence)
    return list(scheduler.admit())


def test_a_request_waits_runs_and_its_prefill_progress_is_computed_tokens():
    scheduler = _scheduler(slots=1)
    first, second = _sequence(0, [1, 2, 3]), _sequence(1, [4, 5])
    assert first.state is RequestState.WAITING
    assert _admit_all(scheduler, first, second) == [first]  # one slot: the second waits
    assert first.state is RequestState.RUNNING and second.state is RequestState.WAITING
    assert first.prompt_left == 3
    first.num_computed = 3
    assert first.prompt_left == 0  # its steps decode
    scheduler.release(first)
    assert first.slot == -1 and list(scheduler.admit()) == [second] and second.slot == 0


def test_the_plan_gives_each_sequence_its_logit_and_hidden_rows():
    """Decoding sequences first (last token + draft, logits for every row), then prompt chunks (logits for the
    last prompt row only when the chunk ends the prompt); hidden rows for every row of every piece."""
    scheduler = _scheduler()
    chain, plain, prompt = _sequence(0, [1, 2]), _sequence(1, [3, 4]), _sequence(2, [5, 6, 7, 8, 9])
    _admit_all(scheduler, chain, plain, prompt)
    for decoding in (chain, plain):
        decoding.num_computed = len(decoding.prompt)
        decoding.generated.append(7)
    budget = scheduler.budget(scheduler.in_slot_order())
    assert budget.decoding == [chain, plain] and budget.prefilling == [prompt]
    plan = scheduler.plan(budget, [DraftProposal(token_ids=(8, 9)), DraftProposal(token_ids=())])
    first, second = plan.decodes
    (chunk,) = plan.prefills
    assert first.piece.token_ids == [7, 8, 9] and first.piece.logits == LOGITS_ALL and first.piece.start == 2
    assert (first.logit_rows, first.hidden_rows) == (slice(0, 3), slice(0, 3))
    assert second.piece.token_ids == [7] and (second.logit_rows, second.hidden_rows) == (slice(3, 4), slice(3, 4))
    assert chunk.proposal is None and chunk.piece.token_ids == [5, 6, 7, 8, 9] and chunk.piece.logits == LOGITS_LAST
    assert (chunk.logit_rows, chunk.hidden_rows) == (slice(4, 5), slice(4, 9))
    assert plan.pieces == [first.piece, second.piece, chunk.piece]
    info = plan.info(committed_tokens=3, pass_s=0.5, draft_s=0.1)
    assert (info.rows, info.draft_rows, info.prefill_rows, info.num_sequences, info.num_decoding, info.ks) == \
        (9, 2, 5, 3, 2, (2, 0))


def test_a_chunk_that_does_not_end_the_prompt_has_no_logit_rows():
    scheduler = _scheduler(slots=2, budget=4, min_prefill=2, hidden=False)
    decoding, prompt = _sequence(0, [1]), _sequence(1, list(range(1, 11)))
    _admit_all(scheduler, decoding, prompt)
    decoding.num_computed = 1
    decoding.generated.append(2)
    budget = scheduler.budget(scheduler.in_slot_order())
    assert budget.prefill_reserve == 2 and budget.draft_rows == 1  # 4 rows - 1 decode row - 2 kept for the prompt
    plan = scheduler.plan(budget, [DraftProposal(token_ids=(3,))])
    (chunk,) = plan.prefills
    assert chunk.piece.token_ids == [1, 2] and chunk.piece.logits == LOGITS_NONE
    assert chunk.logit_rows == slice(2, 2)  # after the decoding sequence's 2 rows, none of its own
    assert chunk.hidden_rows == slice(0, 0)  # the pass returns no hidden states


def test_the_budget_refuses_nonsense_and_fits_drafts():
    with pytest.raises(ValueError):
        _scheduler(budget=0)
    assert within_rows([3, 3, 3], 5) == [3, 2, 0]
    drafts = [DraftProposal(token_ids=(1, 2, 3)), DraftProposal(token_ids=(4, 5))]
    assert [len(p) for p in fit_rows(drafts, 4)] == [3, 1]

"""Verification: decide which draft tokens the target accepts, separately from proposing them."""

from draftwise.verification.greedy import verify_greedy
from draftwise.verification.rejection import verify_sampling
from draftwise.verification.types import VerificationResult

__all__ = ["VerificationResult", "verify_greedy", "verify_sampling"]

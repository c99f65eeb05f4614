"""Speculative decoding: proposers, verification and commit.

Below the engine (DESIGN §2): nothing here imports the engine package. The engine hands this package batch
data only: a `verify.VerifyBatch` per verify step (built from its requests by the engine's
`sampling_batch.verify_batch`), a `proposer.StepCommit` per forward, and one `verify.VerifyShape` per
engine, which the proposer declares and the scheduler, the verify graphs and `adaptive`'s policy take
as is. A host-side proposer reads its sequences through `proposer.DraftedSequence`."""

//! estop ledger (placeholder until its issue lands).

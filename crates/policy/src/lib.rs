//! estop policy (placeholder until its issue lands).

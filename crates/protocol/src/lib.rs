//! estop protocol (placeholder until its issue lands).

//! The daemon end-to-end suite (`e2e.rs`) against the PostgreSQL store: the same tests,
//! compiled again in this target, whose name makes every daemon an `estop serve --store` node on
//! a fresh database of the shared test server (`common::pg::suite_on_postgres`).

#[path = "e2e.rs"]
mod e2e;

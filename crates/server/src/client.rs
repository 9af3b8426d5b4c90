//! The blocking client the CLI and the end-to-end tests use: estop's one client of protocol
//! v1 (`estop_client`), its blocking driver. Kept under this name so the CLI and the tests
//! need not know where it lives.

pub use estop_client::blocking::Client;
pub use estop_client::error::ClientError;

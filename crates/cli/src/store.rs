//! `estop store`: the gate's records moved between the embedded ledger and PostgreSQL
//! (docs/STORES.md, "Moving between stores"). Stop the daemons on both sides first.

use anyhow::Result;
use clap::Subcommand;
use estop_server::pgstore::Target;
use estop_server::storemove;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum StoreCmd {
    /// Copy DATA's embedded ledger into an empty PostgreSQL database.
    Export {
        #[arg(long, env = "ESTOP_DATA", default_value = "estop-data")]
        data: PathBuf,
        /// The database (a password belongs in ESTOP_STORE, not on the command line).
        #[arg(long, value_name = "URL", env = "ESTOP_STORE", hide_env_values = true)]
        to: String,
    },
    /// Write a PostgreSQL database's records into a new embedded ledger in DATA.
    Import {
        /// The database (a password belongs in ESTOP_STORE, not on the command line).
        #[arg(long, value_name = "URL", env = "ESTOP_STORE", hide_env_values = true)]
        from: String,
        #[arg(long, env = "ESTOP_DATA", default_value = "estop-data")]
        data: PathBuf,
    },
}

pub fn run(cmd: StoreCmd) -> Result<u8> {
    match cmd {
        StoreCmd::Export { data, to } => {
            let moved = storemove::export(&data, &Target::parse(&to)?)?;
            println!(
                "exported {} records (last seq {}) from {} to the database; {}",
                moved.records,
                moved.last_seq,
                data.join("ledger").display(),
                match moved.tokens {
                    Some(n) => format!("{n} tokens from DATA/tokens into its registry"),
                    None => "no tokens (no DATA/tokens, or the database has a registry)".into(),
                }
            );
        }
        StoreCmd::Import { from, data } => {
            let moved = storemove::import(&Target::parse(&from)?, &data)?;
            println!(
                "imported {} records (last seq {}) into {}; {}",
                moved.records,
                moved.last_seq,
                data.join("ledger").display(),
                match moved.tokens {
                    Some(n) => format!("{n} live tokens into DATA/tokens (the same secrets)"),
                    None => "DATA/tokens was there already and is left as it was".into(),
                }
            );
        }
    }
    Ok(0)
}

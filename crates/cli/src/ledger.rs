//! `estop ledger`: the ledger files read directly (with or without a running daemon).

use crate::show::esc;
use anyhow::{Result, anyhow};
use clap::Subcommand;
use estop_ledger::{FileStorage, RecordView};
use serde_json::{Value, json};
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum LedgerCmd {
    /// Check every segment and snapshot; exit 0 if a daemon would start on it.
    Verify {
        #[arg(long, env = "ESTOP_DATA", default_value = "estop-data")]
        data: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Print the records (optionally of one run).
    Show {
        #[arg(long, env = "ESTOP_DATA", default_value = "estop-data")]
        data: PathBuf,
        #[arg(long)]
        run: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

pub fn ledger(cmd: LedgerCmd) -> Result<u8> {
    let data = match &cmd {
        LedgerCmd::Verify { data, .. } | LedgerCmd::Show { data, .. } => data,
    };
    let dir = data.join("ledger");
    if !dir.is_dir() {
        return Err(anyhow!("no ledger at {} (pass --data DIR)", dir.display()));
    }
    let storage = FileStorage::open_read_only(&dir)?;
    match cmd {
        LedgerCmd::Verify { json, .. } => Ok(verify(&storage, json)),
        LedgerCmd::Show { run, json, .. } => show(&storage, run.as_deref(), json),
    }
}

/// Prints what `estop_ledger::verify` found; exit 0 if a daemon would start on it, else 1.
fn verify(storage: &FileStorage, json_out: bool) -> u8 {
    let r = estop_ledger::verify(storage);
    let preallocated: u64 = r.segments.iter().map(|s| s.preallocated_bytes).sum();
    if json_out {
        let out = json!({
            "ok": r.is_ok(),
            "segments": r.segments.len(),
            "records": r.records,
            "first_seq": r.first_seq,
            "last_seq": r.last_seq,
            "snapshot_seq": r.snapshot.as_ref().map(|s| s.seq),
            "torn_tail": r.torn_tail.as_ref().map(|t| json!({"segment": t.segment, "offset": t.offset, "bytes": t.bytes_dropped, "reason": t.reason})),
            "preallocated_bytes": preallocated,
            "error": r.error.as_ref().map(ToString::to_string),
        });
        println!("{out}");
    } else {
        println!(
            "segments {}  records {}  seq {}..{}",
            r.segments.len(),
            r.records,
            r.first_seq.unwrap_or(0),
            r.last_seq
        );
        if let Some(s) = &r.snapshot {
            println!("snapshot at seq {}", s.seq);
        }
        if preallocated > 0 {
            println!("preallocated zeros after the last record: {preallocated} bytes");
        }
        if let Some(t) = &r.torn_tail {
            println!(
                "torn tail: {} bytes at {} offset {}: {} (a restart truncates it)",
                t.bytes_dropped, t.segment, t.offset, t.reason
            );
        }
        match &r.error {
            None => println!("ok"),
            Some(e) => println!("CORRUPT: {e}"),
        }
    }
    if r.is_ok() { 0 } else { 1 }
}

/// Prints every record (of `run`, if given), one line or one JSON object each.
fn show(storage: &FileStorage, run: Option<&str>, json_out: bool) -> Result<u8> {
    let mut bad = None;
    let report = estop_ledger::inspect(storage, |rv| {
        if let Err(e) = show_record(&rv, run, json_out) {
            bad = Some(e);
        }
    });
    if let Some(b) = bad {
        return Err(anyhow!("undecodable record: {b}"));
    }
    if let Some(e) = report.error {
        return Err(anyhow!("{e}"));
    }
    Ok(0)
}

fn show_record(rv: &RecordView<'_>, run: Option<&str>, json_out: bool) -> Result<(), String> {
    let rec = estop_kernel::record_codec::decode_record(rv.payload).map_err(|err| {
        format!(
            "seq {} in {} at offset {}: {err}",
            rv.seq, rv.segment, rv.offset
        )
    })?;
    if run.is_some_and(|r| rec.command.run().map(|x| x.as_str()) != Some(r)) {
        return Ok(());
    }
    let e = estop_server::describe::entry(rv.seq, &rec);
    if json_out {
        println!("{}", serde_json::to_string(&e).unwrap_or_default());
        return Ok(());
    }
    let fields: Vec<String> = e
        .fields
        .iter()
        .map(|(k, v)| format!("{k}={}", text(v)))
        .collect();
    println!(
        "{:>8} {} {:<8} {} {} {}",
        e.seq,
        e.at,
        e.kind,
        esc(e.run.as_deref().unwrap_or("-")),
        esc(e.key.as_deref().unwrap_or("-")),
        fields.join(" ")
    );
    Ok(())
}

/// A summary field as text: a string as it is, anything else as JSON; escaped.
fn text(v: &Value) -> String {
    let text = v.as_str().map_or_else(|| v.to_string(), str::to_string);
    esc(&text).into_owned()
}

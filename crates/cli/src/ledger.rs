//! `estop ledger`: the ledger files read directly (with or without a running daemon), or the
//! PostgreSQL store's records (`--store`, `ESTOP_STORE`, or the `store.url` a node wrote into
//! its data directory).

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
        /// Read the PostgreSQL store at this URL instead (default: the data directory's
        /// store.url, if a node on PostgreSQL wrote one).
        #[arg(long, env = "ESTOP_STORE", hide_env_values = true)]
        store: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Print the records (optionally of one run).
    Show {
        #[arg(long, env = "ESTOP_DATA", default_value = "estop-data")]
        data: PathBuf,
        /// As for `verify`.
        #[arg(long, env = "ESTOP_STORE", hide_env_values = true)]
        store: Option<String>,
        #[arg(long)]
        run: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

pub fn ledger(cmd: LedgerCmd) -> Result<u8> {
    let (data, store) = match &cmd {
        LedgerCmd::Verify { data, store, .. } | LedgerCmd::Show { data, store, .. } => {
            (data, store)
        }
    };
    let remembered = data.join(estop_server::pgstore::STORE_FILE);
    let store = match store {
        Some(url) => Some(url.clone()),
        None => std::fs::read_to_string(&remembered)
            .ok()
            .map(|u| u.trim().to_string()),
    };
    if let Some(url) = store {
        let target = estop_server::pgstore::Target::parse(&url)?;
        return match cmd {
            LedgerCmd::Verify { json, .. } => Ok(pg_verify(&target, json)),
            LedgerCmd::Show { run, json, .. } => pg_show(&target, run.as_deref(), json),
        };
    }
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

/// `verify` for the PostgreSQL store: the records numbered with no gap, each replayed, the gate
/// rebuilt from the newest snapshot as a node would; exit 0 if a node would start on it.
fn pg_verify(target: &estop_server::pgstore::Target, json_out: bool) -> u8 {
    let r = estop_server::pgstore::verify(target, &estop_kernel::Limits::default());
    let (ok, records, last, snapshot, error) = match &r {
        Ok(v) => (true, v.records, v.last_seq, v.snapshot_seq, None),
        Err(e) => (false, 0, 0, None, Some(e.to_string())),
    };
    if json_out {
        let out = json!({
            "ok": ok,
            "store": "postgres",
            "records": records,
            "first_seq": (records > 0).then_some(1),
            "last_seq": last,
            "snapshot_seq": snapshot,
            "error": error,
        });
        println!("{out}");
    } else {
        println!("postgres  records {records}  seq 1..{last}");
        if let Some(s) = snapshot {
            println!("snapshot at seq {s}");
        }
        match &error {
            None => println!("ok"),
            Some(e) => println!("CORRUPT: {e}"),
        }
    }
    if ok { 0 } else { 1 }
}

/// `show` for the PostgreSQL store, a page of records at a time.
fn pg_show(
    target: &estop_server::pgstore::Target,
    run: Option<&str>,
    json_out: bool,
) -> Result<u8> {
    let mut db = target.connect()?;
    let mut after = 0;
    loop {
        let page = estop_server::pgstore::records_page(&mut db, after, u64::MAX, run)?;
        let Some((last, _)) = page.last() else {
            return Ok(0);
        };
        after = *last;
        for (seq, bytes) in &page {
            let rec = estop_kernel::record_codec::decode_record(bytes)
                .map_err(|e| anyhow!("undecodable record: seq {seq}: {e}"))?;
            print_entry(&estop_server::describe::entry(*seq, &rec), json_out);
        }
    }
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
    print_entry(&estop_server::describe::entry(rv.seq, &rec), json_out);
    Ok(())
}

fn print_entry(e: &estop_protocol::LedgerEntry, json_out: bool) {
    if json_out {
        println!("{}", serde_json::to_string(e).unwrap_or_default());
        return;
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
}

/// A summary field as text: a string as it is, anything else as JSON; escaped.
fn text(v: &Value) -> String {
    let text = v.as_str().map_or_else(|| v.to_string(), str::to_string);
    esc(&text).into_owned()
}

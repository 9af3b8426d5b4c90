//! In-process measurements of the kernel and the ledger: the CPU work of a cancel among many
//! identities, memory per retained identity (with short keys and with keys shaped like the
//! Python client's), and recovery speed with and without a snapshot, warm and cold.

use estop_kernel::record_codec::{encode_record, encode_snapshot};
use estop_kernel::vocab::{EffectClass, Outcome, PolicyAction, Reversibility};
use estop_kernel::{
    Admit, Command, Digest, EffectKey, Gate, Limits, PolicyDecision, Principal, PrincipalName,
    Record, Role, RunId, RunLimits, Token, ToolName,
};
use estop_ledger::{FileStorage, LedgerOptions, Storage};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

fn agent() -> Principal {
    Principal {
        name: PrincipalName::new("agent").expect("valid"),
        role: Role::Agent,
        groups: vec![],
        part: Default::default(),
    }
}

fn policy() -> PolicyDecision {
    PolicyDecision {
        action: PolicyAction::Allow,
        class: EffectClass::Write,
        reversibility: Reversibility::Undeclared,
        compensate: None,
        compensate_args: None,
        lookup: None,
        lookup_args: None,
        quorum: 1,
        groups: vec![],
        expiry_ms: 900_000,
        rule: "default".into(),
    }
}

/// The shape of the effect keys a benchmark's gate holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyShape {
    /// `step-000042`: 11 bytes, stored inline in the effect (up to 22 bytes are).
    Short,
    /// The Python client's `derive_key` (clients/python/src/estop/keys.py) for a call outside a
    /// named step: `run:{tool}:{occurrence}:{24 hex digits of a sha256}`, here `run:pay:1:…`,
    /// 34 bytes, so stored on the heap.
    Client,
    /// The same for a call inside a step named like a function, `fetch_orders`: 43 bytes.
    ClientInStep,
}

impl KeyShape {
    pub fn name(self) -> &'static str {
        match self {
            KeyShape::Short => "short",
            KeyShape::Client => "client",
            KeyShape::ClientInStep => "client-in-step",
        }
    }
}

/// splitmix64: a fixed, well-mixed stand-in for the client's hash of the call.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key of effect `k` of run number `run`.
pub fn effect_key(shape: KeyShape, run: u64, k: u64) -> String {
    match shape {
        KeyShape::Short => format!("step-{k:06}"),
        KeyShape::Client | KeyShape::ClientInStep => {
            let step = if shape == KeyShape::Client {
                "run"
            } else {
                "fetch_orders"
            };
            let h = mix(run.wrapping_mul(1 << 20) ^ k);
            // Built in a string of the exact size: the bytes per identity are RSS growth, and a
            // temporary that grows by doubling leaves freed chunks of other sizes between the
            // gate's (+16 B per identity measured with `format!` here).
            let mut key = String::with_capacity(step.len() + 31);
            key.push_str(step);
            key.push_str(":pay:1:");
            key.push_str(&format!("{h:016x}"));
            key.push_str(&format!("{:08x}", mix(h) as u32));
            key
        }
    }
}

fn admit(run: &RunId, key: &str, k: u64) -> Command {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&k.to_le_bytes());
    Command::Admit(Admit {
        run: run.clone(),
        key: EffectKey::new(key).expect("valid"),
        tool: ToolName::new("pay").expect("valid"),
        digest: Digest(d),
        args: None,
        start: true,
        parent: None,
        labels: vec![],
        limits: RunLimits::default(),
        policy: Box::new(policy()),
        reserve: Default::default(),
    })
}

fn run_id(i: u64) -> RunId {
    RunId::new(&format!("run-{i:08}")).expect("valid")
}

/// Bounds that a benchmark's one principal never reaches.
fn unbounded() -> Limits {
    Limits {
        runs_max: usize::MAX,
        runs_per_principal_max: usize::MAX,
        tombstones_max: usize::MAX,
        ..Limits::default()
    }
}

/// A gate holding `runs × per_run` completed effect identities with keys of `shape`.
pub fn populated(runs: u64, per_run: u64, shape: KeyShape) -> Gate {
    let mut gate = Gate::new(unbounded());
    let p = agent();
    for r in 0..runs {
        let run = run_id(r);
        for k in 0..per_run {
            let key = effect_key(shape, r, k);
            gate.apply(1, &p, &admit(&run, &key, k))
                .expect("admit applies");
            let key = EffectKey::new(&key).expect("valid");
            let token = Token {
                epoch: 1,
                serial: k + 1,
            };
            let c = Command::Complete {
                run: run.clone(),
                key,
                token,
                outcome: Outcome::Ok,
                result: None,
                error: None,
                cost: Default::default(),
            };
            gate.apply(2, &p, &c).expect("complete applies");
        }
    }
    gate
}

#[derive(Debug, Clone, Copy)]
pub struct CancelReport {
    pub identities: u64,
    pub effects_per_run: u64,
    pub cancels: u64,
    pub p50_us: f64,
    pub max_us: f64,
}

/// The CPU work of cancelling one `per_run`-effect run in a gate of `identities` identities
/// (the fsync before the acknowledgement is not included: it is one group-committed record).
pub fn cancel_cost(identities: u64, per_run: u64, cancels: u64) -> CancelReport {
    let runs = identities / per_run;
    let mut gate = populated(runs, per_run, KeyShape::Short);
    let p = Principal {
        name: PrincipalName::new("admin").expect("valid"),
        role: Role::Operator,
        groups: vec![],
        part: Default::default(),
    };
    let mut ns = Vec::with_capacity(cancels as usize);
    let step = (runs / cancels.max(1)).max(1);
    for i in 0..cancels.min(runs) {
        let cmd = Command::Cancel {
            run: run_id(i * step),
            reason: Some("bench".into()),
            kill: false,
        };
        let t = Instant::now();
        let applied = gate.apply(3, &p, &cmd).expect("cancel applies");
        ns.push(t.elapsed().as_nanos() as f64);
        assert!(applied.changed);
        std::hint::black_box(applied);
    }
    ns.sort_by(f64::total_cmp);
    CancelReport {
        identities: runs * per_run,
        effects_per_run: per_run,
        cancels: ns.len() as u64,
        p50_us: ns[ns.len() / 2] / 1000.0,
        max_us: ns.last().copied().unwrap_or(0.0) / 1000.0,
    }
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

#[derive(Debug, Clone, Copy)]
pub struct MemoryReport {
    pub identities: u64,
    pub bytes_per_identity: f64,
}

/// Resident memory per retained (completed) effect identity with keys of `shape`. The gate is
/// returned so the caller keeps its pages while it measures something else (freed pages would
/// be reused).
pub fn memory_per_identity(identities: u64, per_run: u64, shape: KeyShape) -> (MemoryReport, Gate) {
    let before = rss_bytes();
    let gate = populated(identities / per_run, per_run, shape);
    let after = rss_bytes();
    let report = MemoryReport {
        identities,
        bytes_per_identity: after.saturating_sub(before) as f64 / identities as f64,
    };
    (report, gate)
}

/// Resident memory per tombstone (the fence a forgotten run leaves), with run ids of
/// `id_bytes` bytes. The tombstones are loaded from a snapshot written here in the layout of
/// docs/LEDGER.md (a gate of live runs forgotten in bulk would leave its freed pages for the
/// tombstones to reuse, and the growth would read low). Returned like `memory_per_identity`.
pub fn memory_per_tombstone(tombstones: u64, id_bytes: usize) -> (MemoryReport, Gate) {
    let mut snap = Vec::with_capacity(17 + tombstones as usize * (id_bytes + 40));
    snap.push(estop_kernel::record_codec::SNAPSHOT_VERSION);
    snap.extend_from_slice(&0u64.to_le_bytes()); // no runs
    snap.extend_from_slice(&tombstones.to_le_bytes());
    for i in 0..tombstones {
        let id = format!("{i:0>width$}", width = id_bytes);
        snap.extend_from_slice(&(id.len() as u32).to_le_bytes());
        snap.extend_from_slice(id.as_bytes());
        snap.push(1); // owner
        snap.extend_from_slice(&5u32.to_le_bytes());
        snap.extend_from_slice(b"agent");
        snap.push(0); // cause: cancelled
        snap.extend_from_slice(&2u32.to_le_bytes()); // epoch
        snap.extend_from_slice(&1000u64.to_le_bytes()); // created_at
        snap.extend_from_slice(&(2000 + i).to_le_bytes()); // stopped_at
    }
    let before = rss_bytes();
    let gate = estop_kernel::record_codec::decode_snapshot(&snap, unbounded())
        .expect("the snapshot written above decodes");
    let after = rss_bytes();
    assert_eq!(gate.tombstone_count() as u64, tombstones);
    let report = MemoryReport {
        identities: tombstones,
        bytes_per_identity: after.saturating_sub(before) as f64 / tombstones as f64,
    };
    (report, gate)
}

#[derive(Debug, Clone)]
pub struct RecoveryReport {
    pub records: u64,
    /// Replay of every record with the ledger's files in the page cache (just written).
    pub replay_seconds: f64,
    pub replay_records_per_s: f64,
    /// The same replay after the files were evicted from the page cache.
    pub cold_replay: Result<Cold, String>,
    pub snapshot_bytes: u64,
    /// Recovery from the snapshot, warm and cold.
    pub snapshot_seconds: f64,
    pub cold_snapshot: Result<Cold, String>,
}

/// A recovery timed with the ledger's files out of the page cache.
#[derive(Debug, Clone, Copy)]
pub struct Cold {
    pub seconds: f64,
    /// How they were evicted, and what stayed cached (at most 1%, or this is an `Err`).
    pub evicted: crate::cache::Evicted,
}

/// Evicts `dir` from the page cache, or says why what is read next would not be cold.
fn evict_cold(dir: &Path, method: crate::cache::Method) -> Result<crate::cache::Evicted, String> {
    let evicted = crate::cache::evict(dir, method)
        .map_err(|e| format!("could not evict the ledger from the page cache: {e}"))?;
    if evicted.is_cold() {
        Ok(evicted)
    } else {
        Err(format!(
            "{} left {} of {} bytes of the ledger in the page cache",
            evicted.method.name(),
            evicted.resident_bytes,
            evicted.file_bytes
        ))
    }
}

/// Writes a ledger of about `records` records (runs of 10 admits + 10 completes + close, with
/// retention compaction as a daemon would do), then recovers it by replaying every record and
/// from a snapshot, each warm (files in the page cache) and cold (evicted with `evict` first, see
/// `cache::evict`; a recovery whose files stayed cached is reported as an `Err`, never as cold).
pub fn recovery(
    dir: &Path,
    records: u64,
    evict: crate::cache::Method,
) -> Result<RecoveryReport, Box<dyn std::error::Error>> {
    let _ = std::fs::remove_dir_all(dir);
    let storage: Arc<dyn Storage> = Arc::new(FileStorage::open(dir)?);
    let opened =
        estop_server::journal::open(Arc::clone(&storage), &unbounded(), LedgerOptions::default())?;
    let committer = opened.ledger.spawn(|_| {})?;
    let mut gate = opened.gate;
    let p = agent();
    let mut buf = Vec::with_capacity(256);
    let mut written = 0u64;
    let mut last = 0;
    let mut r = 0u64;
    let mut push = |gate: &mut Gate,
                    cmd: Command,
                    written: &mut u64|
     -> Result<(), Box<dyn std::error::Error>> {
        let rec = Record {
            at: 1000,
            principal: p.clone(),
            command: cmd,
        };
        let applied = gate.apply(rec.at, &rec.principal, &rec.command)?;
        assert!(applied.changed);
        buf.clear();
        encode_record(&rec, &mut buf);
        last = match committer.append(&buf) {
            Err(estop_ledger::LedgerError::Backpressure { .. }) => {
                committer.wait_durable(last)?;
                committer.append(&buf)?
            }
            other => other?,
        };
        *written += 1;
        Ok(())
    };
    while written < records {
        let run = run_id(r);
        for k in 0..10 {
            let key = effect_key(KeyShape::Short, r, k);
            push(&mut gate, admit(&run, &key, k), &mut written)?;
        }
        for k in 0..10 {
            let key = EffectKey::new(&effect_key(KeyShape::Short, r, k))?;
            let c = Command::Complete {
                run: run.clone(),
                key,
                token: Token {
                    epoch: 1,
                    serial: k + 1,
                },
                outcome: Outcome::Ok,
                result: None,
                error: None,
                cost: Default::default(),
            };
            push(&mut gate, c, &mut written)?;
        }
        push(
            &mut gate,
            Command::Close {
                run: run.clone(),
                failed: false,
            },
            &mut written,
        )?;
        r += 1;
        if r.is_multiple_of(20_000) {
            let compact = Command::Compact {
                before: 2000,
                tombstones_before: 0,
            };
            push(&mut gate, compact, &mut written)?;
        }
    }
    committer.flush()?;
    drop(committer);
    drop(gate);

    let open = || -> Result<_, Box<dyn std::error::Error>> {
        Ok(estop_server::journal::open(
            Arc::clone(&storage),
            &unbounded(),
            LedgerOptions::default(),
        )?)
    };
    let t = Instant::now();
    let opened = open()?;
    let replay_seconds = t.elapsed().as_secs_f64();
    let replayed = opened.report.records_replayed;
    let mut snap = Vec::new();
    encode_snapshot(&opened.gate, &mut snap);
    drop(opened);
    let evicted = evict_cold(dir, evict);
    let t = Instant::now();
    let opened = open()?;
    let seconds = t.elapsed().as_secs_f64();
    assert_eq!(opened.report.records_replayed, replayed);
    let cold_replay = evicted.map(|evicted| Cold { seconds, evicted });
    let committer = opened.ledger.spawn(|_| {})?;
    committer.snapshot(opened.report.last_seq, &snap)?;
    drop(committer);
    drop(opened.gate);
    let t = Instant::now();
    let from_snapshot = open()?;
    let snapshot_seconds = t.elapsed().as_secs_f64();
    assert!(from_snapshot.report.snapshot.is_some());
    drop(from_snapshot);
    let evicted = evict_cold(dir, evict);
    let t = Instant::now();
    let from_snapshot = open()?;
    let seconds = t.elapsed().as_secs_f64();
    assert!(from_snapshot.report.snapshot.is_some());
    drop(from_snapshot);
    let cold_snapshot = evicted.map(|evicted| Cold { seconds, evicted });
    let _ = std::fs::remove_dir_all(dir);
    Ok(RecoveryReport {
        records: replayed,
        replay_seconds,
        replay_records_per_s: replayed as f64 / replay_seconds,
        cold_replay,
        snapshot_bytes: snap.len() as u64,
        snapshot_seconds,
        cold_snapshot,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_shaped_keys_are_shaped_like_derive_key_and_not_inline() {
        let keys: Vec<String> = (0..1000)
            .map(|k| effect_key(KeyShape::Client, 7, k))
            .collect();
        for key in &keys {
            // clients/python/src/estop/keys.py: f"{step}:{tool}:{occurrence}:{sha256[:24]}"
            let parts: Vec<&str> = key.split(':').collect();
            assert_eq!(parts[..3], ["run", "pay", "1"], "{key}");
            assert_eq!(parts[3].len(), 24, "{key}");
            assert!(
                parts[3]
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
            );
            // SPEC §5 asks for keys of at least 32 bytes; above 22 bytes a key is not inline.
            assert!(key.len() >= 32, "{key}");
            assert!(EffectKey::new(key).is_ok(), "{key}");
        }
        let distinct: std::collections::BTreeSet<&String> = keys.iter().collect();
        assert_eq!(distinct.len(), keys.len());
        // Another run's keys differ too (the client's hash binds the run).
        assert_ne!(
            effect_key(KeyShape::Client, 8, 0),
            effect_key(KeyShape::Client, 7, 0)
        );
    }

    #[test]
    fn short_keys_fit_inline() {
        assert_eq!(effect_key(KeyShape::Short, 3, 42), "step-000042");
        assert!(effect_key(KeyShape::Short, 0, 999_999).len() <= 22);
    }

    #[test]
    fn a_populated_gate_holds_every_identity_with_either_key_shape() {
        for shape in [KeyShape::Short, KeyShape::Client, KeyShape::ClientInStep] {
            let gate = populated(3, 4, shape);
            let snap = {
                let mut s = Vec::new();
                encode_snapshot(&gate, &mut s);
                s
            };
            let key = effect_key(shape, 2, 3);
            let found = snap.windows(key.len()).any(|w| w == key.as_bytes());
            assert!(found, "{} keys reach the gate's state", shape.name());
        }
    }
}

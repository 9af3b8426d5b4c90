//! Seeded randomized crash test (sled/TigerBeetle style): random appends, flushes, snapshots,
//! injected IO errors, clean reopens and power losses against a trivially correct model. After
//! every reopen, every record acknowledged as durable must be there, in order, and nothing that
//! was never appended. Run one seed with ESTOP_LEDGER_SEED=<n> (printed on failure), or a longer
//! soak with ESTOP_LEDGER_SEEDS=<count>.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use estop_ledger::{Committer, CrashStorage, LedgerOptions, Storage};

use crate::common::open;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// What a snapshot of the first `n` records holds: enough to check it matches the model.
fn state_of(records: &[Vec<u8>]) -> Vec<u8> {
    let mut crc = 0u32;
    for r in records {
        crc = crc32c::crc32c_append(crc, &(r.len() as u32).to_le_bytes());
        crc = crc32c::crc32c_append(crc, r);
    }
    format!("{}:{crc:08x}", records.len()).into_bytes()
}

struct Model {
    /// Every record appended in order since the log began (what the log may contain).
    appended: Vec<Vec<u8>>,
    /// How many of them were acknowledged durable (must survive anything).
    acked: usize,
}

struct World {
    rng: Rng,
    disk: CrashStorage,
    storage: Arc<dyn Storage>,
    opts: LedgerOptions,
    committer: Option<Committer>,
    notified: Arc<AtomicU64>,
    notify_regressed: Arc<AtomicBool>,
    model: Model,
    seen: Seen,
}

/// What the runs exercised, so the test fails if it silently stops testing what it claims.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    crashes: u64,
    torn_tails: u64,
    discards: u64,
    snapshots_loaded: u64,
    superseded: u64,
    records: u64,
}

impl World {
    /// Opens (with `discard_after` if given), checks the recovered log against the model and
    /// adopts it.
    fn reopen(&mut self, discard_after: Option<u64>) {
        assert!(self.committer.is_none());
        let opts = LedgerOptions {
            discard_after,
            ..self.opts.clone()
        };
        let mut tries = 0;
        let o = loop {
            match open(&self.storage, opts.clone()) {
                Ok(o) => break o,
                // A still-armed injected fault or a full disk: heal, then it must succeed.
                Err(e) if tries < 3 && matches!(e.code(), "ledger_io" | "ledger_full") => {
                    self.disk.set_space_left(None);
                    tries += 1;
                }
                Err(e) => panic!("reopen failed: {e}"),
            }
        };
        self.seen.torn_tails += u64::from(o.report.torn_tail.is_some());
        self.seen.discards += u64::from(discard_after.is_some());
        self.seen.snapshots_loaded += u64::from(o.snapshot.is_some());
        self.seen.superseded += u64::from(!o.report.superseded.is_empty());
        let mut log: Vec<Vec<u8>> = Vec::new();
        if let Some((seq, state)) = &o.snapshot {
            let seq = *seq as usize;
            assert!(seq <= self.model.appended.len());
            assert_eq!(
                *state,
                state_of(&self.model.appended[..seq]),
                "snapshot {seq} matches the model"
            );
            log.extend(self.model.appended[..seq].iter().cloned());
        }
        for (seq, payload) in o.records {
            assert_eq!(seq as usize, log.len() + 1, "records are contiguous");
            log.push(payload);
        }
        assert!(
            log.len() >= self.model.acked,
            "lost acknowledged records: recovered {} < acked {}",
            log.len(),
            self.model.acked
        );
        assert!(
            log.len() <= self.model.appended.len(),
            "recovered a record never appended"
        );
        assert!(
            log[..] == self.model.appended[..log.len()],
            "recovered records differ from the appended ones"
        );
        if let Some(d) = discard_after {
            assert_eq!(log.len() as u64, d);
        }
        // What recovery returned is durable now (open syncs it), and is the new truth.
        self.model.appended.truncate(log.len());
        self.model.acked = log.len();
        let notified = Arc::new(AtomicU64::new(log.len() as u64));
        let regressed = self.notify_regressed.clone();
        let n2 = notified.clone();
        self.notified = notified;
        self.committer = Some(
            o.ledger
                .spawn(move |r| {
                    if let Ok(d) = r
                        && n2.swap(d, Ordering::SeqCst) >= d
                    {
                        regressed.store(true, Ordering::SeqCst);
                    }
                })
                .expect("spawn"),
        );
    }

    fn ack(&mut self, seq: u64) {
        self.model.acked = self.model.acked.max(seq as usize);
    }

    /// Drops a failed committer and reopens with discard_after = its durable seq.
    fn recover_if_failed(&mut self) {
        let Some(c) = &self.committer else { return };
        if c.failed().is_some() {
            let d = c.durable();
            self.ack(d);
            self.committer = None;
            self.reopen(Some(d));
        }
    }

    fn step(&mut self) {
        self.recover_if_failed();
        let c = self.committer.clone().expect("open");
        match self.rng.below(100) {
            0..=39 => {
                for _ in 0..=self.rng.below(20) {
                    let len = self.rng.below(self.opts.record_bytes_max as u64 + 1) as usize;
                    let fill = self.rng.next() as u8;
                    let p = vec![fill; len];
                    match c.append(&p) {
                        Ok(seq) => {
                            assert_eq!(seq as usize, self.model.appended.len() + 1);
                            self.model.appended.push(p);
                        }
                        Err(e) if e.code() == "backpressure" => {
                            if let Ok(n) = c.flush() {
                                self.ack(n);
                            }
                        }
                        Err(e) => {
                            assert_eq!(e.code(), "ledger_failed");
                            break;
                        }
                    }
                }
            }
            40..=54 => match c.flush() {
                Ok(n) => {
                    assert_eq!(n as usize, self.model.appended.len());
                    self.ack(n);
                }
                Err(e) => assert_eq!(e.code(), "ledger_failed"),
            },
            55..=61 => {
                let n = self.model.appended.len() as u64;
                if n > 0 {
                    let seq = 1 + self.rng.below(n);
                    if c.wait_durable(seq).is_ok() {
                        self.ack(seq);
                    }
                }
            }
            62..=71 => {
                // Power loss, half the time with a batch written but its sync held open.
                if self.rng.below(2) == 0 {
                    self.disk.pause_syncs(true);
                    let writes = self.disk.stats().writes;
                    for _ in 0..=self.rng.below(10) {
                        match c.append(&[0xAB; 20]) {
                            Ok(_) => self.model.appended.push(vec![0xAB; 20]),
                            Err(_) => break,
                        }
                    }
                    for _ in 0..10_000 {
                        if self.disk.stats().writes > writes {
                            break;
                        }
                        std::thread::yield_now();
                    }
                }
                self.ack(c.durable());
                self.disk.crash();
                self.seen.crashes += 1;
                drop(c);
                self.committer = None;
                self.reopen(None);
            }
            72..=77 => match self.rng.below(4) {
                0 => self.disk.fail_next_sync(),
                1 => self.disk.fail_next_write(),
                2 => self.disk.fail_next_dir_sync(),
                _ => self.disk.set_space_left(Some(self.rng.below(3000))),
            },
            78..=85 => {
                // Clean restart.
                match c.flush() {
                    Ok(n) => {
                        self.ack(n);
                        drop(c);
                        self.committer = None;
                        self.reopen(None);
                        assert_eq!(
                            self.model.acked,
                            self.model.appended.len(),
                            "a clean restart keeps all"
                        );
                    }
                    Err(_) => drop(c),
                }
            }
            _ => {
                let durable = c.durable();
                if durable > 0 {
                    let seq = 1 + self.rng.below(durable);
                    let state = state_of(&self.model.appended[..seq as usize]);
                    if let Err(e) = c.snapshot(seq, &state) {
                        // A write error while writing the snapshot file only fails the snapshot.
                        assert!(
                            matches!(e.code(), "ledger_failed" | "ledger_io" | "ledger_full"),
                            "{e}"
                        );
                        self.disk.set_space_left(None);
                    }
                }
            }
        }
        assert!(
            !self.notify_regressed.load(Ordering::SeqCst),
            "notify went backwards"
        );
    }
}

fn run_seed(seed: u64, steps: usize) -> Seen {
    let mut rng = Rng(seed);
    let disk = CrashStorage::new(rng.next());
    let storage: Arc<dyn Storage> = Arc::new(disk.clone());
    let opts = LedgerOptions {
        record_bytes_max: 64,
        segment_bytes_max: 200 + rng.below(2000),
        buffer_bytes_max: 80 + rng.below(4000) as usize,
        snapshots_keep: 1 + rng.below(3) as usize,
        ..LedgerOptions::default()
    };
    let mut w = World {
        rng,
        disk,
        storage,
        opts,
        committer: None,
        notified: Arc::default(),
        notify_regressed: Arc::default(),
        model: Model {
            appended: Vec::new(),
            acked: 0,
        },
        seen: Seen::default(),
    };
    w.reopen(None);
    for _ in 0..steps {
        w.step();
    }
    // Finally: power loss, and everything acknowledged is still there.
    w.recover_if_failed();
    if let Some(c) = w.committer.take() {
        w.ack(c.durable());
        w.disk.crash();
        drop(c);
    }
    w.reopen(None);
    let v = estop_ledger::verify(&*w.storage);
    assert!(v.is_ok(), "{:?}", v.error);
    w.seen.records = w.model.appended.len() as u64;
    w.seen
}

struct PrintSeedOnPanic(u64);

impl Drop for PrintSeedOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "crash_fuzz failed with seed {0}; rerun with ESTOP_LEDGER_SEED={0}",
                self.0
            );
        }
    }
}

#[test]
fn randomized_crashes_never_lose_an_acknowledged_record() {
    let seeds: Vec<u64> = match std::env::var("ESTOP_LEDGER_SEED") {
        Ok(s) => vec![s.parse().expect("ESTOP_LEDGER_SEED is a number")],
        // ESTOP_LEDGER_SEEDS=<n> runs seeds 0..n (a longer soak).
        Err(_) => (0..std::env::var("ESTOP_LEDGER_SEEDS")
            .map_or(64, |n| n.parse().expect("a number")))
            .collect(),
    };
    let many = seeds.len() > 1;
    let mut total = Seen::default();
    for seed in seeds {
        let _guard = PrintSeedOnPanic(seed);
        let s = run_seed(seed, 300);
        total.crashes += s.crashes;
        total.torn_tails += s.torn_tails;
        total.discards += s.discards;
        total.snapshots_loaded += s.snapshots_loaded;
        total.superseded += s.superseded;
        total.records += s.records;
    }
    eprintln!("crash_fuzz exercised {total:?}");
    if many {
        let t = total;
        assert!(
            t.crashes > 100 && t.torn_tails > 10 && t.discards > 10,
            "{t:?}"
        );
        assert!(
            t.snapshots_loaded > 10 && t.superseded > 10 && t.records > 1000,
            "{t:?}"
        );
    }
}

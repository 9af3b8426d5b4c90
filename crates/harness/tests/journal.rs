//! The journal's compaction: a crash at every step of it leaves a journal that loads with
//! nothing lost and nothing twice; its size stays bounded while trajectories come and go; a
//! read-only reader sees what recovery would, beside a writer.

use estop_harness::budget::{Budget, Limits, Prices};
use estop_harness::chat::{Message, ToolCall};
use estop_harness::journal::{Entry, Journal, JournalError, JournalOptions, Recovered, read_only};
use estop_harness::machine::State;
use estop_harness::record::{CallLimits, Exit, Grants, Identity, PendingCall, Phase, Record};
use estop_ledger::{CrashStorage, MemStorage};
use std::sync::Arc;

fn rec(id: &str, state: State, ended_at_ms: Option<u64>) -> Record {
    let mut r = Record::new(
        Identity {
            id: id.into(),
            parent: Some("parent-run".into()),
            tenant: "default".into(),
            task: format!("task of {id}"),
            ..Identity::default()
        },
        CallLimits {
            model: "m".into(),
            max_output_tokens: 100,
            call_deadline_ms: 1_000,
            tool_deadline_ms: 500,
            retry: Default::default(),
        },
        Budget::new(
            Limits {
                turns_max: Some(5),
                ..Limits::default()
            },
            Prices::default(),
            0,
        ),
        Grants {
            tools: Vec::new(),
            restricted: false,
        },
        "journal".into(),
    );
    r.state = state;
    r.ended_at_ms = ended_at_ms;
    if state.is_terminal() {
        r.exit = Some(Exit::Completed { check_passed: true });
    }
    r
}

fn record(r: Record) -> Entry {
    Entry::Record {
        record: Box::new(r),
    }
}

fn say(id: &str, text: &str) -> Entry {
    Entry::Context {
        trajectory: id.into(),
        message: Message::user(text),
    }
}

const NOW: u64 = 10_000_000;

/// A live trajectory with a dispatched call (what a resume must not run again), an ended one
/// retention keeps and two it drops (one by count, one by age).
fn fixture(j: &Journal) {
    let mut live = rec("live", State::WaitingTool, None);
    live.pending.push(PendingCall {
        call: ToolCall::new("c1", "drop_table", "{}"),
        phase: Phase::Dispatched {
            deadline_ms: NOW + 60_000,
            token: "tok".into(),
        },
    });
    j.write(&[say("live", "hello"), say("live", "go on"), record(live)])
        .unwrap();
    for (id, at) in [
        ("recent", NOW - 1_000),
        ("older", NOW - 2_000),
        ("ancient", 1),
    ] {
        j.write(&[
            say(id, "question"),
            say(id, &format!("answer of {id}")),
            record(rec(id, State::Completed, Some(at))),
        ])
        .unwrap();
    }
    j.write(&[Entry::Log {
        trajectory: "live".into(),
        line: "a note".into(),
    }])
    .unwrap();
}

fn opts() -> JournalOptions {
    JournalOptions {
        compact_bytes: u64::MAX,
        ended_keep: 1,
        ended_keep_ms: 3_600_000,
        segment_bytes_max: 2 << 20,
    }
}

fn open(s: &CrashStorage) -> (Journal, Recovered) {
    Journal::open_storage(Arc::new(s.clone()), opts()).unwrap()
}

#[test]
fn a_crash_at_every_step_of_a_compaction_loses_and_repeats_nothing() {
    let mut full_seen = 0;
    let mut k = 0;
    loop {
        let s = CrashStorage::new(k);
        let (j, _) = open(&s);
        fixture(&j);
        drop(j);
        // Reopened (a second segment), so that retention has a segment to remove.
        let (j, full) = open(&s);
        let mut compacted = full.clone();
        let dropped = compacted.retain(NOW, &opts());
        assert_eq!(dropped, vec!["older".to_string(), "ancient".to_string()]);
        assert_eq!(
            compacted.contexts["recent"],
            vec![Message::user("answer of recent")]
        );
        s.crash_at_op(Some(k));
        let done = j.compact(NOW);
        s.crash_at_op(None);
        s.crash();
        drop(j);
        let (j, got) = open(&s);
        // Nothing lost, nothing twice: the live trajectory whole, its dispatched call with it.
        assert_eq!(got.records["live"], full.records["live"], "crash at op {k}");
        assert_eq!(
            got.contexts["live"], full.contexts["live"],
            "crash at op {k}"
        );
        if got == full {
            full_seen += 1;
        } else {
            assert_eq!(got, compacted, "crash at op {k}: neither before nor after");
        }
        // What comes after a crashed compaction is kept once, and survives the next one.
        let mut live = full.records["live"].clone();
        live.turns += 1;
        j.write(&[say("live", "after"), record(live.clone())])
            .unwrap();
        j.compact(NOW).unwrap();
        drop(j);
        let (_, again) = open(&s);
        let mut want = full.contexts["live"].clone();
        want.push(Message::user("after"));
        assert_eq!(again.contexts["live"], want, "crash at op {k}");
        assert_eq!(again.records["live"], live, "crash at op {k}");
        assert_eq!(again.records.len(), 2, "crash at op {k}: live and recent");
        if let Ok(Some(c)) = done {
            assert_eq!(got, compacted, "a compaction that returned is on disk");
            assert!(
                !c.removed.is_empty(),
                "retention removed the covered segment"
            );
            break;
        }
        k += 1;
        assert!(k < 100, "the compaction never completed");
    }
    // tmp create, write header, write payload, sync, rename, directory sync, removals...
    assert!(k >= 5, "only {k} steps");
    assert!(
        full_seen >= 4,
        "a crash before the rename keeps the journal as it was"
    );
}

fn stored_bytes(s: &MemStorage) -> u64 {
    s.files().values().map(|f| f.len() as u64).sum()
}

/// 5,000 trajectories start, talk and end while one stays live: with compaction the journal's
/// files stay under 4 MiB (3.2 MB at most, measured) while about 21 MB is appended; without it
/// they hold it all.
#[test]
fn the_journal_stays_bounded_while_trajectories_come_and_go() {
    let run = |compact_bytes: u64| -> (u64, u64, Recovered) {
        let s = MemStorage::new();
        let o = JournalOptions {
            compact_bytes,
            ended_keep: 10,
            ended_keep_ms: u64::MAX,
            segment_bytes_max: 2 << 20,
        };
        let (j, _) = Journal::open_storage(Arc::new(s.clone()), o).unwrap();
        j.write(&[
            say("keeper", "stay"),
            record(rec("keeper", State::Paused, None)),
        ])
        .unwrap();
        let text = "x".repeat(800);
        let mut max = 0;
        for i in 0..5_000u64 {
            let id = format!("t{i}");
            j.write(&[say(&id, &text), record(rec(&id, State::Ready, None))])
                .unwrap();
            j.write(&[
                say(&id, &text),
                say(&id, &text),
                record(rec(&id, State::Completed, Some(i + 1))),
            ])
            .unwrap();
            if i % 50 == 0 {
                max = max.max(stored_bytes(&s));
            }
        }
        max = max.max(stored_bytes(&s));
        drop(j);
        let (_, got) = Journal::open_storage(Arc::new(s.clone()), o).unwrap();
        (max, stored_bytes(&s), got)
    };
    let (max, end, got) = run(256 << 10);
    eprintln!("compacted every 256 KiB: at most {max} bytes, {end} at the end");
    assert!(max < 4 << 20, "the journal grew to {max} bytes");
    assert_eq!(got.contexts["keeper"], vec![Message::user("stay")]);
    assert!(got.records.contains_key("keeper"));
    // The keeper and the 10 most recently ended, and no more (compacted at least once since).
    assert!(
        got.records.len() <= 1 + 10 + 5_000 / 100,
        "{}",
        got.records.len()
    );
    assert!(got.records.contains_key("t4999"));
    assert!(!got.records.contains_key("t0"));
    let (max, end, got) = run(u64::MAX);
    eprintln!("never compacted: {end} bytes at the end");
    assert!(max > 20 << 20 && end > 20 << 20, "uncompacted: {max}");
    assert_eq!(got.records.len(), 5_001);
}

#[test]
fn a_reader_beside_the_writer_sees_what_recovery_would() {
    let dir = tempfile::tempdir().unwrap();
    let jdir = dir.path().join("journal");
    assert_eq!(read_only(&jdir, 1 << 20).unwrap(), Recovered::default());
    let (j, _) = Journal::open_with(&jdir, opts()).unwrap();
    fixture(&j);
    let seen = read_only(&jdir, 64 << 20).unwrap();
    assert_eq!(seen.records.len(), 4);
    assert_eq!(seen.contexts["live"].len(), 2);
    j.compact(NOW).unwrap().unwrap();
    let after = read_only(&jdir, 64 << 20).unwrap();
    assert_eq!(
        after.records.len(),
        2,
        "the snapshot, without what retention left out"
    );
    assert_eq!(after.contexts["live"], seen.contexts["live"]);
    // A torn tail (a record being written) is left out, not an error; nothing is changed.
    let seg = std::fs::read_dir(&jdir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .max()
        .unwrap();
    let before = std::fs::read(&seg).unwrap();
    let mut torn = before.clone();
    let end = torn.iter().rposition(|b| *b != 0).unwrap() + 1;
    torn.truncate(end);
    torn.extend_from_slice(&[0x40, 0, 0, 0, 0xde, 0xad]);
    std::fs::write(&seg, &torn).unwrap();
    assert_eq!(read_only(&jdir, 64 << 20).unwrap(), after);
    assert_eq!(
        std::fs::read(&seg).unwrap(),
        torn,
        "the reader changed nothing"
    );
    match read_only(&jdir, 1_000) {
        Err(JournalError::TooLarge { bytes_max, .. }) => assert_eq!(bytes_max, 1_000),
        other => panic!("{other:?}"),
    }
    // A corruption that stays (a flipped byte mid-log, whole records after it) is reported,
    // after the reader tried again in case a writer was under it.
    let mut bad = before.clone();
    bad[end / 2] ^= 0xff;
    std::fs::write(&seg, &bad).unwrap();
    match read_only(&jdir, 64 << 20) {
        Err(JournalError::Ledger(e)) => assert!(e.to_string().contains("corrupt"), "{e}"),
        other => panic!("{other:?}"),
    }
    drop(j);
}

/// A reader in a loop while the writer appends, rolls segments and compacts (removing files
/// under the reader): every read succeeds and sees the live trajectory whole.
#[test]
fn reads_beside_a_compacting_writer_always_see_a_whole_state() {
    let dir = tempfile::tempdir().unwrap();
    let jdir = dir.path().join("journal");
    let o = JournalOptions {
        compact_bytes: 64 << 10,
        ended_keep: 10,
        ended_keep_ms: u64::MAX,
        segment_bytes_max: 2 << 20,
    };
    let (j, _) = Journal::open_with(&jdir, o).unwrap();
    j.write(&[
        say("keeper", "stay"),
        record(rec("keeper", State::Paused, None)),
    ])
    .unwrap();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (jdir, done) = (jdir.clone(), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut reads = 0u64;
            while !done.load(std::sync::atomic::Ordering::Relaxed) || reads == 0 {
                let s = read_only(&jdir, 64 << 20).unwrap_or_else(|e| panic!("read {reads}: {e}"));
                assert_eq!(
                    s.contexts["keeper"],
                    vec![Message::user("stay")],
                    "read {reads}"
                );
                assert_eq!(s.records["keeper"].state, State::Paused, "read {reads}");
                reads += 1;
            }
            reads
        })
    };
    let text = "y".repeat(3_000);
    for i in 0..2_500u64 {
        let id = format!("t{i}");
        j.write(&[
            say(&id, &text),
            record(rec(&id, State::Completed, Some(i + 1))),
        ])
        .unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let reads = reader.join().unwrap();
    let files: Vec<String> = std::fs::read_dir(&jdir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    eprintln!("{reads} reads beside the writer; files at the end: {files:?}");
    assert!(reads > 1);
}

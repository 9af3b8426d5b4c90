//! The PostgreSQL store (docs/STORES.md) against real `estop serve --store` processes and a real
//! PostgreSQL server (`scripts/postgres`, started once per test run and shared; each test has a
//! database of its own). When the server cannot start these tests fail, unless
//! `ESTOP_TEST_SKIP_POSTGRES=1` says to skip them.

mod common;

use common::pg::{database, server, sql};
use common::*;
use serde_json::json;
use std::io::Read;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A node on the database at `url`.
fn node(url: &str) -> Daemon {
    Daemon::start_with(&["--store", url, "--console", "off"])
}

/// How many admit records of `run`/`key` the database holds (decoded by estop's own reader
/// would need the codec: the key is checked through a node instead; this counts the run's).
fn admits(url: &str, run: &str) -> i64 {
    sql(url)
        .query_one(
            "SELECT count(*) FROM estop_ledger WHERE run_id = $1 AND command = 'admit'",
            &[&run],
        )
        .unwrap()
        .get(0)
}

#[test]
fn one_node_admits_decides_waits_and_cancels_and_a_restart_rebuilds_from_the_database() {
    let Some(url) = database() else { return };
    let mut d = node(&url);
    let (mut a, mut op) = (d.agent(), d.operator());
    assert_eq!(
        verdict(&admit(&mut a, "r1", "k1", "refund", json!({"usd": 5}))),
        "held"
    );
    let v = ok(
        &mut op,
        json!({"op": "decide", "run": "r1", "key": "k1", "decision": "approve"}),
    );
    assert_eq!(v["status"], "approved");
    let v = ok(
        &mut a,
        json!({"op": "wait", "run": "r1", "key": "k1", "timeout_ms": 5000}),
    );
    assert_eq!(verdict(&v), "admitted");
    ok(
        &mut op,
        json!({"op": "cancel", "run": "r1", "reason": "enough"}),
    );
    let v = admit(&mut a, "r1", "k2", "pay", json!({}));
    assert_eq!(
        (verdict(&v), v["reason"].as_str()),
        ("refused", Some("cancelled"))
    );
    assert_eq!(
        admits(&url, "r1"),
        1,
        "the refused admission changed nothing"
    );
    // The node keeps nothing of its own: restarted, it rebuilds the gate from the database.
    d.restart();
    let mut a = d.agent();
    let v = admit(&mut a, "r1", "k1", "refund", json!({"usd": 5}));
    assert_eq!(verdict(&v), "duplicate", "{v}");
    let v = admit(&mut a, "r1", "k3", "pay", json!({}));
    assert_eq!(
        (verdict(&v), v["reason"].as_str()),
        ("refused", Some("cancelled"))
    );
}

#[test]
fn the_same_identity_admitted_through_two_nodes_at_once_is_admitted_once() {
    let Some(url) = database() else { return };
    let n1 = node(&url);
    let n2 = node_beside(&url, &n1);
    for round in 0..20 {
        let run = format!("r{round}");
        let verdicts = Arc::new(Mutex::new(Vec::new()));
        let threads: Vec<_> = [&n1, &n2, &n1, &n2]
            .iter()
            .map(|n| {
                let (mut c, run, verdicts) = (n.agent(), run.clone(), Arc::clone(&verdicts));
                std::thread::spawn(move || {
                    let v = admit(&mut c, &run, "once", "pay", json!({"usd": 1}));
                    verdicts.lock().unwrap().push(verdict(&v).to_string());
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let verdicts = verdicts.lock().unwrap();
        let admitted = verdicts.iter().filter(|v| *v == "admitted").count();
        assert_eq!(admitted, 1, "round {round}: {verdicts:?}");
        assert!(
            verdicts
                .iter()
                .all(|v| ["admitted", "duplicate", "in_progress"].contains(&v.as_str())),
            "round {round}: {verdicts:?}"
        );
        assert_eq!(admits(&url, &run), 1, "round {round}");
    }
}

#[test]
fn a_cancel_on_one_node_fences_a_start_on_the_other() {
    let Some(url) = database() else { return };
    let n1 = node(&url);
    let n2 = node_beside(&url, &n1);
    let mut b = n2.agent();
    let prep = ok(
        &mut b,
        json!({"op": "admit", "run": "r1", "key": "p", "tool": "pay", "args": {}, "start": false}),
    );
    let token = prep["token"].as_str().unwrap().to_string();
    let mut sub = n2.agent();
    ok(&mut sub, json!({"op": "subscribe", "run": "r1"}));
    ok(
        &mut n1.operator(),
        json!({"op": "cancel", "run": "r1", "reason": "stop"}),
    );
    // Node 2's subscriber hears of node 1's cancel (caught up, then published there).
    let ev = sub.next_event().unwrap().unwrap();
    assert_eq!(ev.run, "r1");
    let v = ok(
        &mut b,
        json!({"op": "start", "run": "r1", "key": "p", "token": token}),
    );
    assert_eq!(
        (verdict(&v), v["reason"].as_str()),
        ("refused", Some("cancelled"))
    );
}

#[test]
fn an_approval_on_one_node_releases_a_wait_on_the_other() {
    let Some(url) = database() else { return };
    let n1 = node(&url);
    let n2 = node_beside(&url, &n1);
    let mut a = n1.agent();
    let reply = |a: &mut estop_server::client::Client| match a.read_line().unwrap() {
        estop_protocol::ServerLine::Reply(r) => r,
        other => panic!("{other:?}"),
    };
    // Several rounds: a wake-up of node 1 lost once (its flag left set) is lost for good.
    for round in 0..5 {
        let run = format!("r{round}");
        assert_eq!(
            verdict(&admit(&mut a, &run, "k1", "refund", json!({}))),
            "held"
        );
        // The wait, then a status on the same connection: the core takes a connection's
        // requests in order, so the status's reply arriving first shows the wait is parked.
        let wait = json!({"id": 100, "op": "wait", "run": run, "key": "k1", "timeout_ms": 60000});
        a.send_raw(wait.to_string().as_bytes()).unwrap();
        let status = json!({"id": 101, "op": "status", "run": run});
        a.send_raw(status.to_string().as_bytes()).unwrap();
        assert_eq!(reply(&mut a).id.as_u64(), Some(101));
        let decided = std::time::Instant::now();
        let v = ok(
            &mut n2.operator(),
            json!({"op": "decide", "run": run, "key": "k1", "decision": "approve"}),
        );
        assert_eq!(v["status"], "approved");
        let r = reply(&mut a);
        assert_eq!(r.id.as_u64(), Some(100));
        assert_eq!(verdict(&r.raw), "admitted", "{}", r.raw);
        // Released by the approval, not by the wait's own end (which answers `admitted` too,
        // re-checking then): far sooner than its 60 s.
        assert!(
            decided.elapsed() < std::time::Duration::from_secs(30),
            "round {round}: the wait ended at its timeout, not at the approval"
        );
    }
}

#[test]
fn a_quorum_gathered_across_nodes_counts_each_principal_once() {
    let Some(url) = database() else { return };
    let n1 = node(&url);
    let n2 = node_beside(&url, &n1);
    let (code, secret, stderr) = n2.cli(&["token", "create", "bob", "--role", "operator"]);
    assert_eq!(code, 0, "{stderr}");
    let mut a = n1.agent();
    assert_eq!(
        verdict(&admit(&mut a, "r1", "k1", "wire", json!({"usd": 1e6}))),
        "held"
    );
    let decide = json!({"op": "decide", "run": "r1", "key": "k1", "decision": "approve"});
    let v = ok(&mut n1.operator(), decide.clone());
    assert_eq!(v["status"], "held", "one approval of two");
    // `admin` again, through the other node: the same principal, not a second approver.
    assert_eq!(err_code(&mut n2.operator(), decide.clone()), "conflict");
    let v = ok(
        &mut a,
        json!({"op": "wait", "run": "r1", "key": "k1", "timeout_ms": 0}),
    );
    assert_eq!(verdict(&v), "held");
    let v = ok(&mut n2.client_with(secret.trim()), decide);
    assert_eq!(v["status"], "approved");
    let v = ok(
        &mut a,
        json!({"op": "wait", "run": "r1", "key": "k1", "timeout_ms": 5000}),
    );
    assert_eq!(verdict(&v), "admitted");
}

#[test]
fn kill9_mid_load_loses_no_acknowledged_admission() {
    let Some(url) = database() else { return };
    let mut d = node(&url);
    let acked = Arc::new(Mutex::new(Vec::new()));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (mut c, acked) = (d.agent(), Arc::clone(&acked));
            std::thread::spawn(move || {
                for i in 0.. {
                    let req = json!({"op": "admit", "run": format!("t{t}"), "key": format!("k{i}"),
                                     "tool": "pay", "args": {"i": i}});
                    match c.call(req) {
                        Ok(r) if r.ok => acked.lock().unwrap().push((t, i)),
                        _ => return, // The node is gone.
                    }
                }
            })
        })
        .collect();
    // Kill it once some admissions are acknowledged (the clients keep going meanwhile).
    while acked.lock().unwrap().len() < 200 {
        std::thread::yield_now();
    }
    d.kill9();
    for t in threads {
        t.join().unwrap();
    }
    let acked = acked.lock().unwrap().clone();
    let mut db = sql(&url);
    for t in 0..4 {
        let n: i64 = db
            .query_one(
                "SELECT count(*) FROM estop_ledger WHERE run_id = $1 AND command = 'admit'",
                &[&format!("t{t}")],
            )
            .unwrap()
            .get(0);
        let acked_here = acked.iter().filter(|(x, _)| *x == t).count() as i64;
        assert!(
            n >= acked_here,
            "run t{t}: {acked_here} acknowledged, {n} recorded"
        );
    }
    d.spawn();
    let mut c = d.agent();
    for (t, i) in acked {
        let v = admit(
            &mut c,
            &format!("t{t}"),
            &format!("k{i}"),
            "pay",
            json!({"i": i}),
        );
        assert_eq!(verdict(&v), "duplicate", "t{t}/k{i} was acknowledged: {v}");
    }
}

/// Makes every commit that inserts a record of run `doomed` fail at COMMIT (a deferred
/// constraint trigger): the insert succeeds, the commit does not.
fn doom_commits(url: &str) {
    sql(url)
        .batch_execute(
            "CREATE FUNCTION estop_test_doom() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               IF NEW.run_id = 'doomed' THEN RAISE EXCEPTION 'doomed at commit'; END IF;
               RETURN NULL;
             END $$;
             CREATE CONSTRAINT TRIGGER estop_test_doom AFTER INSERT ON estop_ledger
               DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION estop_test_doom();",
        )
        .unwrap();
}

#[test]
fn a_commit_that_fails_is_never_acknowledged_and_the_node_recovers() {
    let Some(url) = database() else { return };
    let mut d = node(&url); // Migrated: the table exists.
    doom_commits(&url);
    let plant = std::env::var("ESTOP_TEST_PLANT_REPLY_BEFORE_COMMIT").is_ok_and(|v| v == "1");
    if plant {
        d.kill9();
        d.spawn_env(&[("ESTOP_DEBUG_PLANT_REPLY_BEFORE_COMMIT", "1")]);
    }
    let mut a = d.agent();
    let r = a
        .call(json!({"op": "admit", "run": "doomed", "key": "k", "tool": "pay", "args": {}}))
        .unwrap();
    assert!(!r.ok, "a reply for a record whose commit failed: {}", r.raw);
    assert_eq!(r.error.unwrap().code, "unavailable");
    assert_eq!(admits(&url, "doomed"), 0);
    // The node rebuilt its gate from the database and goes on.
    let v = admit(&mut d.agent(), "fine", "k", "pay", json!({}));
    assert_eq!(verdict(&v), "admitted", "{v}");
    assert_eq!(admits(&url, "fine"), 1);
}

/// Ends the connections of the nodes on the database of `url` (waiting until they are gone).
fn cut(url: &str) -> i64 {
    let db_name = url.rsplit_once('/').unwrap().1.to_string();
    sql(server().unwrap())
        .query_one(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity
              WHERE datname = $1 AND application_name = 'estop') t",
            &[&db_name],
        )
        .unwrap()
        .get(0)
}

fn allow_connections(url: &str, allow: bool) {
    let db_name = url.rsplit_once('/').unwrap().1.to_string();
    sql(server().unwrap())
        .batch_execute(&format!(
            "ALTER DATABASE {db_name} WITH ALLOW_CONNECTIONS {allow}"
        ))
        .unwrap();
}

#[test]
fn a_node_that_loses_its_database_fails_closed_and_recovers() {
    let Some(url) = database() else { return };
    let d = node(&url);
    let mut a = d.agent();
    assert_eq!(
        verdict(&admit(&mut a, "r1", "k1", "pay", json!({}))),
        "admitted"
    );
    // A cut connection is replaced before the next burst begins.
    assert!(cut(&url) >= 1, "the node's connections");
    assert_eq!(
        verdict(&admit(&mut a, "r1", "k2", "pay", json!({}))),
        "admitted"
    );
    // The database refuses the node: nothing is acknowledged.
    allow_connections(&url, false);
    assert!(cut(&url) >= 1);
    let r = a
        .call(json!({"op": "admit", "run": "r1", "key": "k3", "tool": "pay", "args": {}}))
        .unwrap();
    assert!(!r.ok, "no reply without a commit: {}", r.raw);
    assert_eq!(r.error.unwrap().code, "unavailable");
    // Back: the node rebuilds its gate from the database (it retries every second) and goes
    // on. Every answer meanwhile is `unavailable` or an admission that is recorded.
    allow_connections(&url, true);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let r = a
            .call(json!({"op": "admit", "run": "r1", "key": "k4", "tool": "pay", "args": {}}))
            .unwrap();
        if r.ok {
            assert_eq!(verdict(&r.raw), "admitted", "{}", r.raw);
            break;
        }
        assert_eq!(r.error.unwrap().code, "unavailable");
        assert!(
            std::time::Instant::now() < deadline,
            "the node did not recover"
        );
    }
    assert_eq!(admits(&url, "r1"), 3, "k1, k2 and k4; never k3");
}

#[test]
fn a_database_with_a_newer_schema_is_refused_at_start() {
    let Some(url) = database() else { return };
    drop(node(&url)); // Migrated to this binary's version.
    sql(&url)
        .batch_execute("INSERT INTO estop_schema (version) VALUES (999)")
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(bin())
        .args(["serve", "--console", "off", "--store", &url, "--data"])
        .arg(dir.path())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("schema version 999, newer than this estop"),
        "{stderr}"
    );
}

#[test]
fn two_nodes_under_load_number_every_record_once() {
    let Some(url) = database() else { return };
    let n1 = node(&url);
    let n2 = node_beside(&url, &n1);
    let threads: Vec<_> = (0..6)
        .map(|t| {
            let mut c = if t % 2 == 0 { n1.agent() } else { n2.agent() };
            std::thread::spawn(move || {
                for i in 0..40 {
                    // Runs shared by the nodes, keys of their own.
                    let v = admit(
                        &mut c,
                        &format!("r{}", i % 3),
                        &format!("t{t}-{i}"),
                        "pay",
                        json!({}),
                    );
                    assert_eq!(verdict(&v), "admitted", "{v}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let row = sql(&url)
        .query_one(
            "SELECT count(*), max(seq), count(*) FILTER (WHERE command = 'admit') FROM estop_ledger",
            &[],
        )
        .unwrap();
    let (n, max, admits): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    assert_eq!(n, max, "seqs 1..=max, no gap");
    assert_eq!(admits, 240);
    // Either node answers for every admission made through the other.
    let (mut c1, mut c2) = (n1.agent(), n2.agent());
    for t in 0..6 {
        let c = if t % 2 == 0 { &mut c2 } else { &mut c1 };
        let v = admit(c, "r0", &format!("t{t}-0"), "pay", json!({}));
        assert_eq!(verdict(&v), "duplicate", "{v}");
    }
}

/// The store's URL (with its password) can come from ESTOP_STORE instead of the command line,
/// where every local user could read it in the process list: the node then keeps its truth in
/// that database, and its command line names none.
#[test]
fn the_store_url_can_stay_out_of_the_process_list() {
    let Some(url) = database() else { return };
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policy.toml"), POLICY).unwrap();
    let mut d = Daemon {
        dir,
        child: None,
        ready: String::new(),
        extra: vec!["--console".into(), "off".into()],
    };
    d.spawn_env(&[("ESTOP_STORE", url.as_str())]);
    let pid = d.child.as_ref().unwrap().id();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains("postgres://"),
        "the URL is not in argv"
    );
    let mut agent = d.agent();
    let v = ok(
        &mut agent,
        json!({"op": "admit", "run": "env", "key": "k", "tool": "search", "args": {}}),
    );
    assert_eq!(v["verdict"], "admitted", "{v}");
    assert_eq!(admits(&url, "env"), 1, "the admission is in the database");
}

/// `estop store export` and `import` move one history between the stores, both ways, and only
/// into an empty destination: a gate started on the copy knows every effect (a repeat is a
/// duplicate, a cancelled run stays fenced, a held effect is still held) and numbers on from it.
#[test]
fn a_history_moves_between_the_embedded_ledger_and_postgresql_both_ways() {
    let Some(url) = database() else { return };
    // An embedded gate with a history: an admitted call, a held one, a cancelled run.
    let mut embedded = Daemon::start_with(&["--console", "off"]);
    let (mut a, mut op) = (embedded.agent(), embedded.operator());
    assert_eq!(
        verdict(&admit(&mut a, "m1", "k1", "pay", json!({"usd": 1}))),
        "admitted"
    );
    assert_eq!(
        verdict(&admit(&mut a, "m1", "k2", "refund", json!({"usd": 2}))),
        "held"
    );
    assert_eq!(
        verdict(&admit(&mut a, "m2", "k1", "pay", json!({}))),
        "admitted"
    );
    ok(
        &mut op,
        json!({"op": "cancel", "run": "m2", "reason": "moved"}),
    );
    let data = embedded.data().to_path_buf();
    // Not while a gate runs on it: what it appended after the copy would be lost to it.
    let busy = Command::new(bin())
        .args(["store", "export", "--data"])
        .arg(&data)
        .args(["--to", &url])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&busy.stderr);
    assert!(
        !busy.status.success() && said.contains("in use by a running estop serve"),
        "{said}"
    );
    embedded.kill9();
    let store = |args: &[&str]| {
        let out = Command::new(bin())
            .arg("store")
            .args(args)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let data_arg = data.display().to_string();
    let (ok1, said) = store(&["export", "--data", &data_arg, "--to", &url]);
    assert!(ok1, "{said}");
    assert!(said.contains("exported"), "{said}");
    assert!(said.contains("2 tokens from DATA/tokens"), "{said}");
    let exported = admits(&url, "m1") + admits(&url, "m2");
    assert_eq!(exported, 3);
    // Never a second history into the same database: refused, nothing added.
    let (again, said) = store(&["export", "--data", &data_arg, "--to", &url]);
    assert!(!again && said.contains("already holds"), "{said}");
    assert_eq!(admits(&url, "m1") + admits(&url, "m2"), 3);

    // A node on the database knows the history, and goes on from it; the tokens came with
    // it: the embedded gate's secrets work there.
    let node_pg = node_beside(&url, &embedded);
    let mut a = node_pg.agent();
    assert_eq!(
        verdict(&admit(&mut a, "m1", "k1", "pay", json!({"usd": 1}))),
        "duplicate"
    );
    assert_eq!(
        verdict(&admit(&mut a, "m1", "k2", "refund", json!({"usd": 2}))),
        "held"
    );
    let v = admit(&mut a, "m2", "k9", "pay", json!({}));
    assert_eq!(
        (verdict(&v), v["reason"].as_str()),
        ("refused", Some("cancelled"))
    );
    assert_eq!(
        verdict(&admit(&mut a, "m3", "k1", "pay", json!({}))),
        "admitted"
    );
    drop(node_pg);

    // And back: into a fresh data directory, which a gate then starts on.
    let fresh = tempfile::tempdir().unwrap();
    std::fs::write(fresh.path().join("policy.toml"), POLICY).unwrap();
    let fresh_arg = fresh.path().display().to_string();
    let (ok2, said) = store(&["import", "--from", &url, "--data", &fresh_arg]);
    assert!(ok2, "{said}");
    assert!(
        said.contains("imported") && said.contains("2 live tokens into DATA/tokens"),
        "{said}"
    );
    for f in ["operator.token", "agent.token"] {
        std::fs::copy(data.join(f), fresh.path().join(f)).unwrap();
    }
    let (twice, said) = store(&["import", "--from", &url, "--data", &fresh_arg]);
    assert!(!twice && said.contains("already holds a ledger"), "{said}");
    let mut back = Daemon {
        dir: fresh,
        child: None,
        ready: String::new(),
        extra: vec!["--console".into(), "off".into()],
    };
    back.spawn();
    let (mut a, mut op) = (back.agent(), back.operator());
    assert_eq!(
        verdict(&admit(&mut a, "m3", "k1", "pay", json!({}))),
        "duplicate"
    );
    let v = admit(&mut a, "m2", "k9", "pay", json!({}));
    assert_eq!(
        (verdict(&v), v["reason"].as_str()),
        ("refused", Some("cancelled"))
    );
    let pending = ok(&mut op, json!({"op": "pending", "run": "m1"}));
    assert_eq!(pending["pending"][0]["key"], "k2", "{pending}");
}

/// `estop bench store` runs end to end against a real server: the raw commit probe, then one
/// and two nodes, every admission answered (no errors).
#[test]
fn the_store_benchmark_measures_one_and_two_nodes() {
    let Some(url) = database() else { return };
    let data = tempfile::tempdir().unwrap();
    let out = Command::new(bin())
        .args([
            "bench",
            "store",
            "--connections",
            "1,4",
            "--ops",
            "200",
            "--probe-seconds",
            "0.2",
            "--json",
            "--data",
        ])
        .arg(data.path())
        .env("ESTOP_STORE", &url)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        rows[0]["raw_commit"]["commits_per_s"].as_f64().unwrap() > 0.0,
        "{text}"
    );
    let steps: Vec<_> = rows[1..]
        .iter()
        .map(|r| {
            (
                r["nodes"].as_u64().unwrap(),
                r["connections"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(steps, [(1, 1), (1, 4), (2, 1), (2, 4)], "{text}");
    assert!(
        rows[1..]
            .iter()
            .all(|r| r["errors"] == 0 && r["admissions_per_s"].as_f64().unwrap() > 0.0),
        "{text}"
    );
}

/// Whether the run asks the crash tests to run against the planted reply-before-commit.
fn planted() -> bool {
    std::env::var("ESTOP_TEST_PLANT_REPLY_BEFORE_COMMIT").is_ok_and(|v| v == "1")
}

/// A node killed (kill -9) in the middle of a burst's transaction: its records are inserted
/// but not committed (a trigger holds the INSERT on a lock the test holds). Its client gets no
/// acknowledgement, and once the server ends the dead session nothing of the burst is
/// visible: the same admission through the restarted node is a fresh one.
#[test]
fn a_node_killed_mid_transaction_acknowledged_nothing_and_left_nothing() {
    let Some(url) = database() else { return };
    let mut d = node(&url);
    if planted() {
        d.kill9();
        d.spawn_env(&[("ESTOP_DEBUG_PLANT_REPLY_BEFORE_COMMIT", "1")]);
    }
    assert_eq!(
        verdict(&admit(&mut d.agent(), "r0", "k", "pay", json!({}))),
        "admitted"
    );
    let mut holder = sql(&url);
    holder
        .execute("SELECT pg_advisory_lock(4242)", &[])
        .unwrap();
    sql(&url)
        .batch_execute(
            "CREATE FUNCTION estop_test_stall() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               IF NEW.run_id = 'stalled' THEN PERFORM pg_advisory_xact_lock(4242); END IF;
               RETURN NEW;
             END $$;
             CREATE TRIGGER estop_test_stall BEFORE INSERT ON estop_ledger
               FOR EACH ROW EXECUTE FUNCTION estop_test_stall();",
        )
        .unwrap();
    let mut a = d.agent();
    let client = std::thread::spawn(move || {
        a.call(json!({"op": "admit", "run": "stalled", "key": "k", "tool": "pay", "args": {}}))
    });
    // The node's transaction has inserted and now waits inside the trigger.
    common::pg::until(
        &url,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = 4242",
        1,
    );
    d.kill9();
    // An error (the connection died with the node) is no acknowledgement either.
    if let Ok(r) = client.join().unwrap() {
        assert!(!r.ok, "acknowledged before its commit: {}", r.raw);
    }
    holder
        .execute("SELECT pg_advisory_unlock(4242)", &[])
        .unwrap();
    // The server notices the dead session once the trigger returns, and rolls it back.
    let db_name = url.rsplit_once('/').unwrap().1;
    common::pg::until(
        &url,
        &format!(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = '{db_name}' AND application_name = 'estop'"
        ),
        0,
    );
    assert_eq!(
        admits(&url, "stalled"),
        0,
        "an uncommitted burst is visible"
    );
    d.spawn();
    let v = admit(&mut d.agent(), "stalled", "k", "pay", json!({}));
    assert_eq!(
        verdict(&v),
        "admitted",
        "a fresh admission, not a duplicate: {v}"
    );
    assert_eq!(admits(&url, "stalled"), 1);
}

/// PostgreSQL restarted as after a crash (immediate: every session cut, crash recovery), three
/// times, while eight clients admit through a node: the node answers `unavailable` while the database is
/// gone (it fails closed), takes admissions again once the database is back, and every
/// admission it acknowledged, before or after, is in the database and a duplicate after.
#[test]
fn a_postgresql_restart_under_load_fails_the_node_closed_and_loses_nothing_acknowledged() {
    if server().is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("estop-test-pg-restart-{}", std::process::id()));
    let url = common::pg::database_on(&common::pg::start_private(&dir, &[]));
    let mut d = node(&url);
    if planted() {
        d.kill9();
        d.spawn_env(&[("ESTOP_DEBUG_PLANT_REPLY_BEFORE_COMMIT", "1")]);
    }
    let acked = Arc::new(Mutex::new(Vec::new()));
    let refused = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (mut c, acked, refused, stop) = (
                d.agent(),
                Arc::clone(&acked),
                Arc::clone(&refused),
                Arc::clone(&stop),
            );
            std::thread::spawn(move || {
                for i in 0.. {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let req = json!({"op": "admit", "run": format!("t{t}"), "key": format!("k{i}"),
                                     "tool": "pay", "args": {}});
                    let r = c.call(req).unwrap();
                    if r.ok {
                        assert_eq!(verdict(&r.raw), "admitted", "{}", r.raw);
                        acked.lock().unwrap().push((t, i));
                    } else {
                        assert_eq!(r.error.unwrap().code, "unavailable");
                        refused.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    let acked_count = || acked.lock().unwrap().len();
    // Three restarts, each once admissions flow again: each cuts whatever burst is in flight
    // (its lock, its read, its insert or its COMMIT).
    for _ in 0..3 {
        let before = acked_count();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while acked_count() < before + 200 {
            assert!(
                std::time::Instant::now() < deadline,
                "the node did not recover"
            );
            std::thread::yield_now();
        }
        common::pg::control("restart", &dir);
    }
    let before = acked_count();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while acked_count() < before + 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "the node did not recover"
        );
        std::thread::yield_now();
    }
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    assert!(
        refused.load(Ordering::SeqCst) > 0,
        "the restart cut no burst: nothing tested"
    );
    let acked = acked.lock().unwrap().clone();
    let mut c = d.agent();
    for (t, i) in &acked {
        let v = admit(&mut c, &format!("t{t}"), &format!("k{i}"), "pay", json!({}));
        assert_eq!(verdict(&v), "duplicate", "t{t}/k{i} was acknowledged: {v}");
    }
    drop(d);
    common::pg::control("stop", &dir);
}

/// A restart of PostgreSQL breaks the token registry's connection too; the first `hello`
/// after it is answered (the lookup, a read, tried once more on a fresh connection), not
/// refused `unavailable` with the broken pipe (found in CI: the node had recovered its commits
/// and a new client still could not say hello).
#[test]
fn the_first_hello_after_a_postgresql_restart_is_answered() {
    if server().is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("estop-test-pg-hello-{}", std::process::id()));
    let url = common::pg::database_on(&common::pg::start_private(&dir, &[]));
    let d = node(&url);
    // The registry's connection is open and used.
    drop(d.agent());
    common::pg::control("restart", &dir);
    let mut db = sql(&url);
    let _: i64 = db.query_one("SELECT 1::bigint", &[]).unwrap().get(0);
    let agent = estop_server::client::Client::connect_as(&d.socket(), &d.token("agent.token"));
    assert!(agent.is_ok(), "{:?}", agent.err());
    drop(d);
    common::pg::control("stop", &dir);
}

/// A node that starts reads the newest snapshot in the database and only the records after it:
/// with the first record made unreadable (a node replaying every record cannot start), a node
/// snapshotting every 10 records restarts and knows every admission.
#[test]
fn a_node_starts_from_the_newest_snapshot_in_the_database() {
    let Some(url) = database() else { return };
    let mut d = Daemon::start_with(&[
        "--store",
        &url,
        "--console",
        "off",
        "--snapshot-every",
        "10",
    ]);
    let mut a = d.agent();
    for i in 0..45 {
        let v = admit(&mut a, "r1", &format!("k{i}"), "pay", json!({"i": i}));
        assert_eq!(verdict(&v), "admitted", "{v}");
    }
    let (snapshots, newest): (i64, i64) = {
        let row = sql(&url)
            .query_one(
                "SELECT count(*), coalesce(max(seq), 0) FROM estop_snapshot",
                &[],
            )
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(snapshots, 1, "the newest replaces the ones before it");
    assert!(
        newest >= 40,
        "a snapshot every 10 records: the newest at {newest}"
    );
    d.kill9();
    sql(&url)
        .execute(
            "UPDATE estop_ledger SET record = '\\x00'::bytea WHERE seq = 1",
            &[],
        )
        .unwrap();
    d.spawn();
    let mut a = d.agent();
    for i in 0..45 {
        let v = admit(&mut a, "r1", &format!("k{i}"), "pay", json!({"i": i}));
        assert_eq!(verdict(&v), "duplicate", "k{i}: {v}");
    }
}

/// A node far behind (stopped with SIGSTOP while the other committed more records than one
/// page of the catch-up read) catches up page by page in its next burst: it answers for the
/// last of them, and numbers its own records after them.
#[test]
fn a_node_far_behind_catches_up_page_by_page() {
    let Some(url) = database() else { return };
    let n1 = node(&url);
    let n2 = node_beside(&url, &n1);
    let pid = n2.child.as_ref().unwrap().id().to_string();
    let signal = |sig: &str| {
        let ok = Command::new("kill").args([sig, &pid]).status().unwrap();
        assert!(ok.success());
    };
    signal("-STOP");
    let threads: Vec<_> = (0..16)
        .map(|t| {
            let mut c = n1.agent();
            std::thread::spawn(move || {
                for i in 0..300 {
                    let v = admit(&mut c, &format!("r{t}"), &format!("k{i}"), "pay", json!({}));
                    assert_eq!(verdict(&v), "admitted", "{v}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let behind: i64 = sql(&url)
        .query_one("SELECT max(seq) FROM estop_ledger", &[])
        .unwrap()
        .get(0);
    assert!(behind > 4096, "more than one page: {behind}");
    signal("-CONT");
    let mut c = n2.agent();
    let v = admit(&mut c, "r15", "k299", "pay", json!({}));
    assert_eq!(verdict(&v), "duplicate", "{v}");
    let v = admit(&mut c, "late", "k", "pay", json!({}));
    assert_eq!(verdict(&v), "admitted", "{v}");
    assert_eq!(admits(&url, "late"), 1);
}

/// A CA and a certificate for `localhost` it signed (the server's), as PEM: (ca, cert, key).
fn tls_material() -> (String, String, String) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "estop test CA");
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    (ca_pem, cert.pem(), key.serialize_pem())
}

/// `estop serve --store URL` that must not start; its stderr. One that starts is stopped
/// and fails the test (rather than leaving the test waiting on it).
fn refused_at_start(url: &str) -> String {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(bin())
        .args(["serve", "--console", "off", "--store", url, "--data"])
        .arg(dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    if stdout
        .lines()
        .map_while(Result::ok)
        .any(|l| l.starts_with("estop ready"))
    {
        child.kill().unwrap();
        child.wait().unwrap();
        panic!("a node started on {url}");
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "started on {url}: {stderr}");
    stderr
}

/// TLS to the database: a server of the test's own with a certificate for `localhost` from a CA
/// the test makes, refusing every connection without TLS. `sslmode=verify-full` with that CA
/// connects (and the server sees the node's sessions encrypted); with another CA, or to a host
/// the certificate does not name, the node does not start; `verify-ca` checks the chain but not
/// the name; `require` encrypts without checking; `disable` is refused by the server.
#[test]
fn tls_to_the_database_honours_sslmode() {
    if server().is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("estop-test-pg-tls-{}", std::process::id()));
    let base = common::pg::start_private(&dir, &[]);
    let plain = common::pg::database_on(&base);
    let db_name = plain.rsplit_once('/').unwrap().1.to_string();
    let port = base
        .rsplit_once(':')
        .unwrap()
        .1
        .split('/')
        .next()
        .unwrap()
        .to_string();
    let data = dir.join("data");
    let (ca, cert, key) = tls_material();
    let (other_ca, _, _) = tls_material();
    let owner = std::fs::metadata(&data).unwrap();
    for (name, pem) in [("server.crt", &cert), ("server.key", &key)] {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let path = data.join(name);
        std::fs::write(&path, pem).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::chown(&path, Some(owner.uid()), Some(owner.gid())).unwrap();
    }
    let keys = tempfile::tempdir().unwrap();
    let (ca_file, other_file) = (keys.path().join("ca.pem"), keys.path().join("other.pem"));
    std::fs::write(&ca_file, &ca).unwrap();
    std::fs::write(&other_file, &other_ca).unwrap();
    let hba = std::fs::read_to_string(data.join("pg_hba.conf")).unwrap();
    std::fs::write(
        data.join("pg_hba.conf"),
        format!("hostnossl all all 0.0.0.0/0 reject\nhostnossl all all ::/0 reject\n{hba}"),
    )
    .unwrap();
    let mut admin = sql(&base);
    admin.batch_execute("ALTER SYSTEM SET ssl = on").unwrap();
    admin.batch_execute("SELECT pg_reload_conf()").unwrap();
    // The reload is the server's to do: wait until it refuses a connection without TLS.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while postgres::Client::connect(&plain, postgres::NoTls).is_ok() {
        assert!(
            std::time::Instant::now() < deadline,
            "the server still takes plain connections"
        );
        std::thread::yield_now();
    }
    let url = |host: &str, query: &str| format!("postgres://estop@{host}:{port}/{db_name}?{query}");
    let full = url(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={}", ca_file.display()),
    );
    let d = node(&full);
    assert_eq!(
        verdict(&admit(&mut d.agent(), "tls", "k", "pay", json!({}))),
        "admitted"
    );
    let encrypted: i64 = estop_server::pgstore::Target::parse(&full)
        .unwrap()
        .connect()
        .unwrap()
        .query_one(
            "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid)
              WHERE ssl AND application_name = 'estop' AND datname = $1",
            &[&db_name],
        )
        .unwrap()
        .get(0);
    assert!(
        encrypted >= 3,
        "the node's two sessions and this one: {encrypted}"
    );
    // The first node's bootstrap secrets, for the nodes after it (the registry is the database's).
    for f in ["operator.token", "agent.token"] {
        std::fs::copy(d.data().join(f), keys.path().join(f)).unwrap();
    }
    drop(d);
    let said = refused_at_start(&url(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={}", other_file.display()),
    ));
    assert!(said.contains("certificate"), "{said}");
    let said = refused_at_start(&url(
        "127.0.0.1",
        &format!("sslmode=verify-full&sslrootcert={}", ca_file.display()),
    ));
    assert!(said.contains("certificate"), "{said}");
    let ca_only = url(
        "127.0.0.1",
        &format!("sslmode=verify-ca&sslrootcert={}", ca_file.display()),
    );
    let d = node_with_secrets(&ca_only, keys.path());
    assert_eq!(
        verdict(&admit(&mut d.agent(), "tls", "k", "pay", json!({}))),
        "duplicate"
    );
    drop(d);
    let d = node_with_secrets(&url("127.0.0.1", "sslmode=require"), keys.path());
    assert_eq!(
        verdict(&admit(&mut d.agent(), "tls", "k2", "pay", json!({}))),
        "admitted"
    );
    drop(d);
    let said = refused_at_start(&url("127.0.0.1", "sslmode=disable"));
    assert!(
        said.contains("no encryption") || said.contains("pg_hba"),
        "{said}"
    );
    common::pg::control("stop", &dir);
}

/// `estop ledger show|verify` read the database a node writes to (named by the `store.url` it
/// keeps in its data directory, mode 0600): every record shown, and a gap found.
#[test]
fn ledger_show_and_verify_read_the_database() {
    use std::os::unix::fs::PermissionsExt;
    let Some(url) = database() else { return };
    let mut d = node(&url);
    let mut a = d.agent();
    for i in 0..3 {
        admit(&mut a, "shown", &format!("k{i}"), "pay", json!({}));
    }
    let mode = std::fs::metadata(d.data().join("store.url"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    // A file left readable by others (restored from a backup, say) is narrowed at the next
    // start, before the URL is written into it again.
    d.kill9();
    let file = d.data().join("store.url");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    d.restart();
    let mode = std::fs::metadata(&file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let mut a = d.agent();
    admit(&mut a, "shown", "k3", "pay", json!({}));
    d.kill9();
    let (code, out, err) = d.cli(&["ledger", "show", "--run", "shown"]);
    assert_eq!((code, out.matches(" admit ").count()), (0, 4), "{out}{err}");
    let (code, out, _) = d.cli(&["ledger", "verify", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!((code, v["ok"].as_bool()), (0, Some(true)), "{out}");
    sql(&url)
        .execute("DELETE FROM estop_ledger WHERE seq = 2", &[])
        .unwrap();
    let (code, out, _) = d.cli(&["ledger", "verify"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("seq 2 is missing"), "{out}");
}

const UNDO_POLICY: &str = r#"
[[rules]]
tool = "refund"
action = "allow"
compensate = "unrefund"
compensate_args = '{"refund": result.id}'
"#;

/// The `compensate` events `c` was sent before the replies to two requests of its own (a
/// node offers in the timer pass after a burst, so an offer the first request's burst led to
/// comes before the second's reply).
fn compensates_sent(c: &mut estop_server::client::Client) -> Vec<String> {
    let mut got = Vec::new();
    for _ in 0..2 {
        let id = c.raw_next_id();
        let line = format!(r#"{{"id":{id},"op":"status","run":"r1"}}"#);
        c.raw_send_line(line.as_bytes()).unwrap();
        loop {
            let line = c.raw_read_line().unwrap();
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            if v["event"] == "compensate" {
                got.push(line);
            } else if v["id"] == id {
                break;
            }
        }
    }
    got
}

#[test]
fn a_cancel_on_one_node_is_undone_through_the_other_and_each_attempt_offered_by_one_node() {
    let Some(url) = database() else { return };
    let args = ["--store", url.as_str(), "--console", "off"];
    let n1 = Daemon::start_with_policy(UNDO_POLICY, &args);
    let n2 = node_with_policy(&url, UNDO_POLICY, n1.data());
    let mut a = n1.agent();
    let v = admit(&mut a, "r1", "k1", "refund", json!({}));
    ok(
        &mut a,
        json!({"op": "complete", "run": "r1", "key": "k1", "token": v["token"],
               "outcome": "ok", "result": {"id": "re_1"}}),
    );
    let mut ex2 = n2.agent();
    ok(&mut ex2, json!({"op": "compensations", "run": "r1"}));
    ok(&mut n1.operator(), json!({"op": "cancel", "run": "r1"}));
    // Node 2 catches up node 1's cancel and offers the undo to its executor: nothing else
    // wakes node 2's saga.
    let e = loop {
        let ev = ex2.next_event().unwrap().expect("an event");
        if ev.event == estop_protocol::EventKind::Compensate {
            break ev;
        }
    };
    assert_eq!(
        (e.key.as_deref(), e.attempt, e.args.clone()),
        (Some("k1"), Some(1), Some(json!({"refund": "re_1"})))
    );
    // An executor on node 1 now: node 1 catches up node 2's begin, so the attempt under way is
    // node 2's, and node 1 does not offer it a second time.
    let mut ex1 = n1.agent();
    ok(&mut ex1, json!({"op": "compensations", "run": "r1"}));
    assert_eq!(compensates_sent(&mut ex1), Vec::<String>::new());
    ok(
        &mut ex2,
        json!({"op": "compensated", "run": "r1", "key": "k1", "attempt": 1, "outcome": "ok"}),
    );
    let st = ok(&mut n1.operator(), json!({"op": "status", "run": "r1"}));
    assert_eq!(st["state"], "cancelled", "{st}");
    let begins: i64 = sql(&url)
        .query_one(
            "SELECT count(*) FROM estop_ledger WHERE command = 'compensation_begin'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(begins, 1);
}

/// A second node on the database at `url`, in a data dir of its own holding `first`'s secrets
/// (the operator's and the agent's): on a PostgreSQL store the tokens are every node's.
fn node_beside(url: &str, first: &Daemon) -> Daemon {
    node_with_secrets(url, first.data())
}

/// A node on the database at `url` with the operator's and the agent's secrets of `from`.
fn node_with_secrets(url: &str, from: &std::path::Path) -> Daemon {
    node_with_policy(url, POLICY, from)
}

/// A node on the database at `url` with `policy` and the operator's and the agent's secrets
/// of `from`.
fn node_with_policy(url: &str, policy: &str, from: &std::path::Path) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policy.toml"), policy).unwrap();
    for f in ["operator.token", "agent.token"] {
        std::fs::copy(from.join(f), dir.path().join(f)).unwrap();
    }
    let mut d = Daemon {
        dir,
        child: None,
        ready: String::new(),
        extra: vec![
            "--store".into(),
            url.into(),
            "--console".into(),
            "off".into(),
        ],
    };
    d.spawn();
    d
}

/// `estop token create NAME --role ROLE` through `d`; the secret.
fn create_token(d: &Daemon, name: &str, role: &str) -> String {
    let (code, out, err) = d.cli(&["token", "create", name, "--role", role]);
    assert_eq!(code, 0, "token create {name}: {err}");
    out.trim().to_string()
}

/// A hello with `token` on `d`: the error code of its refusal, or None when it is let in.
fn hello_refused(d: &Daemon, token: &str) -> Option<String> {
    let mut c = estop_server::client::Client::connect(&d.socket()).unwrap();
    let r = c.call(json!({"op": "hello", "token": token})).unwrap();
    r.error.map(|e| e.code)
}

/// Reads `conn` until the gate ends it; what it said.
fn ended(conn: &mut std::io::BufReader<std::os::unix::net::UnixStream>) -> String {
    let mut rest = String::new();
    conn.get_ref()
        .set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    let eof = conn.read_to_string(&mut rest);
    assert!(eof.is_ok(), "the connection was not closed: {eof:?} {rest}");
    rest
}

/// An authenticated idle v1 connection to `d`.
fn idle_conn(
    d: &Daemon,
    token: &str,
) -> (
    std::os::unix::net::UnixStream,
    std::io::BufReader<std::os::unix::net::UnixStream>,
) {
    use std::io::{BufRead, Write};
    let s = std::os::unix::net::UnixStream::connect(d.socket()).unwrap();
    let mut r = std::io::BufReader::new(s.try_clone().unwrap());
    let mut w = s;
    writeln!(w, "{}", json!({"id": 0, "op": "hello", "token": token})).unwrap();
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(line.contains("\"ok\":true"), "{line}");
    (w, r)
}

/// The token registry is the database's: a token made on node A works on node B; revoked on
/// B, it is refused on A at its next hello and A closes the connections that hold it; the
/// table holds the secret's SHA-256, never the secret. Then the other way round.
#[test]
fn a_token_made_on_one_node_works_on_the_other_and_a_revocation_on_either_ends_it_on_both() {
    let Some(url) = database() else { return };
    let a = node(&url);
    let b = node_beside(&url, &a);
    let carol = create_token(&a, "carol", "agent");
    let mut on_b = b.client_with(&carol);
    assert_eq!(
        verdict(&admit(&mut on_b, "tok", "k1", "pay", json!({}))),
        "admitted"
    );
    let (hash, name): (Vec<u8>, String) = {
        let row = sql(&url)
            .query_one(
                "SELECT hash, name FROM estop_token WHERE name = 'carol'",
                &[],
            )
            .unwrap();
        (row.get(0), row.get(1))
    };
    use sha2::Digest as _;
    assert_eq!(
        hash,
        sha2::Sha256::digest(carol.as_bytes()).to_vec(),
        "{name}"
    );
    let dump: String = sql(&url)
        .query_one("SELECT string_agg(t::text, ' ') FROM estop_token t", &[])
        .unwrap()
        .get(0);
    assert!(!dump.contains(&carol), "the secret is not stored");

    let (_w, mut idle_on_a) = idle_conn(&a, &carol);
    let (code, out, err) = b.cli(&["token", "revoke", "carol"]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        hello_refused(&a, &carol).as_deref(),
        Some("unauthenticated"),
        "revoked on B, refused on A at once"
    );
    let said = ended(&mut idle_on_a);
    assert!(said.contains("revoked"), "{said}");

    // The other way: made on B, revoked on A.
    let dave = create_token(&b, "dave", "operator");
    assert_eq!(hello_refused(&a, &dave), None);
    let (_w, mut idle_on_b) = idle_conn(&b, &dave);
    let (code, out, err) = a.cli(&["token", "revoke", "dave"]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(hello_refused(&b, &dave).as_deref(), Some("unauthenticated"));
    assert!(ended(&mut idle_on_b).contains("revoked"));
    // A name is one live token across nodes.
    let (code, _, err) = b.cli(&["token", "create", "carol2", "--role", "agent"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = a.cli(&["token", "create", "carol2", "--role", "agent"]);
    assert_ne!(code, 0);
    assert!(err.contains("already exists"), "{err}");
}

/// Authentication asks the database, not the node's copy: a token revoked in the table by
/// hand (no notification) is refused at the next hello at once, and the disagreement found
/// there refreshes the node's copy, which closes the open connection that holds it.
#[test]
fn a_token_revoked_in_the_database_is_refused_at_the_next_hello() {
    let Some(url) = database() else { return };
    let a = node(&url);
    let erin = create_token(&a, "erin", "agent");
    let (_w, mut idle) = idle_conn(&a, &erin);
    sql(&url)
        .execute(
            "UPDATE estop_token SET revoked_at = now() WHERE name = 'erin'",
            &[],
        )
        .unwrap();
    assert_eq!(hello_refused(&a, &erin).as_deref(), Some("unauthenticated"));
    assert!(ended(&mut idle).contains("revoked"));
}

/// The first node on a database makes the bootstrap tokens (once: a second node makes none);
/// an empty registry in a database that holds records is refused at start, naming
/// `--reset-tokens`, which then makes fresh bootstrap tokens that work.
#[test]
fn the_first_node_bootstraps_the_registry_and_reset_tokens_refills_a_lost_one() {
    let Some(url) = database() else { return };
    let a = node(&url);
    let b = Daemon::start_with(&["--store", &url, "--console", "off"]);
    assert!(!b.data().join("operator.token").exists(), "made once");
    let rows: i64 = sql(&url)
        .query_one("SELECT count(*) FROM estop_token", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 2, "admin and agent");
    assert_eq!(hello_refused(&b, &a.token("operator.token")), None);
    drop((a, b));
    sql(&url).execute("DELETE FROM estop_token", &[]).unwrap();
    let said = refused_at_start(&url);
    assert!(said.contains("--reset-tokens"), "{said}");
    let c = Daemon::start_with(&["--store", &url, "--console", "off", "--reset-tokens"]);
    assert_eq!(
        verdict(&admit(&mut c.agent(), "reset", "k", "pay", json!({}))),
        "admitted"
    );
    ok(&mut c.operator(), json!({"op": "runs"}));
}

/// PEM of a CA, a server certificate for `localhost` and a client certificate for the
/// database user `estop` (its CN, as `cert` authentication wants), all signed by that CA:
/// (ca, server cert, server key, client cert, client key).
fn tls_material_with_client() -> [String; 5] {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "estop test CA");
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let server_key = rcgen::KeyPair::generate().unwrap();
    let server = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&server_key, &issuer)
        .unwrap();
    let client_key = rcgen::KeyPair::generate().unwrap();
    let mut client = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    client
        .distinguished_name
        .push(rcgen::DnType::CommonName, "estop");
    client.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let client = client.signed_by(&client_key, &issuer).unwrap();
    [
        ca_pem,
        server.pem(),
        server_key.serialize_pem(),
        client.pem(),
        client_key.serialize_pem(),
    ]
}

/// Writes `pem` to `path` with mode 0600.
fn private_file(path: &std::path::Path, pem: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, pem).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// TLS client certificates: a server of the test's own that takes only TLS connections
/// authenticated by a certificate from the test's CA (`hostssl … cert`). A node with
/// `sslcert`/`sslkey` starts and the server sees its sessions under the certificate's name;
/// without them, or with a certificate from another CA, it does not start; a key file that
/// is missing or readable by others is a start error naming it.
#[test]
fn a_client_certificate_authenticates_the_node_to_the_database() {
    if server().is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("estop-test-pg-cert-{}", std::process::id()));
    let base = common::pg::start_private(&dir, &[]);
    let plain = common::pg::database_on(&base);
    let (rest, db_name) = plain.rsplit_once('/').unwrap();
    let port = rest.rsplit_once(':').unwrap().1.to_string();
    let data = dir.join("data");
    let [ca, cert, key, client_cert, client_key] = tls_material_with_client();
    let [other_ca, _, _, other_cert, other_key] = tls_material_with_client();
    let owner = std::fs::metadata(&data).unwrap();
    for (name, pem) in [
        ("server.crt", &cert),
        ("server.key", &key),
        ("root.crt", &ca),
    ] {
        use std::os::unix::fs::MetadataExt;
        let path = data.join(name);
        private_file(&path, pem);
        std::os::unix::fs::chown(&path, Some(owner.uid()), Some(owner.gid())).unwrap();
    }
    let keys = tempfile::tempdir().unwrap();
    let file = |name: &str, pem: &str| {
        let path = keys.path().join(name);
        private_file(&path, pem);
        path.display().to_string()
    };
    let ca_file = file("ca.pem", &ca);
    let _ = other_ca;
    let (cert_file, key_file) = (file("c.pem", &client_cert), file("c.key", &client_key));
    let (other_cert, other_key) = (file("o.pem", &other_cert), file("o.key", &other_key));
    let hba = std::fs::read_to_string(data.join("pg_hba.conf")).unwrap();
    std::fs::write(
        data.join("pg_hba.conf"),
        format!(
            "hostnossl all all 0.0.0.0/0 reject\nhostnossl all all ::/0 reject\n\
             hostssl all all 0.0.0.0/0 cert\nhostssl all all ::/0 cert\n{hba}"
        ),
    )
    .unwrap();
    let mut admin = sql(&base);
    admin.batch_execute("ALTER SYSTEM SET ssl = on").unwrap();
    admin
        .batch_execute("ALTER SYSTEM SET ssl_ca_file = 'root.crt'")
        .unwrap();
    admin.batch_execute("SELECT pg_reload_conf()").unwrap();
    // The reload is the server's to do: wait until it refuses a connection without TLS.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while postgres::Client::connect(&plain, postgres::NoTls).is_ok() {
        assert!(
            std::time::Instant::now() < deadline,
            "the server still takes plain connections"
        );
        std::thread::yield_now();
    }
    let url = |cert: &str, key: &str| {
        let mut u = format!(
            "postgres://estop@localhost:{port}/{db_name}?sslmode=verify-full&sslrootcert={ca_file}"
        );
        if !cert.is_empty() {
            u.push_str(&format!("&sslcert={cert}&sslkey={key}"));
        }
        u
    };
    let with_cert = url(&cert_file, &key_file);
    let d = node(&with_cert);
    assert_eq!(
        verdict(&admit(&mut d.agent(), "cert", "k", "pay", json!({}))),
        "admitted"
    );
    let by_cert: i64 = estop_server::pgstore::Target::parse(&with_cert)
        .unwrap()
        .connect()
        .unwrap()
        .query_one(
            "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid)
              WHERE client_dn = '/CN=estop' AND application_name = 'estop' AND datname = $1",
            &[&db_name],
        )
        .unwrap()
        .get(0);
    assert!(by_cert >= 3, "the node's sessions and this one: {by_cert}");
    drop(d);
    let said = refused_at_start(&url("", ""));
    assert!(said.contains("certificate"), "{said}");
    let said = refused_at_start(&url(&other_cert, &other_key));
    assert!(
        said.contains("certificate") || said.contains("alert"),
        "{said}"
    );
    let missing = keys.path().join("none.key").display().to_string();
    let said = refused_at_start(&url(&cert_file, &missing));
    assert!(
        said.contains("sslkey=") && said.contains("none.key"),
        "{said}"
    );
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let said = refused_at_start(&with_cert);
    assert!(said.contains("chmod 600"), "{said}");
    common::pg::control("stop", &dir);
}

/// The commands of `run`'s effect `key` in the ledger table, in order, by its `effect_key`
/// column (the operators' query of docs/STORES.md).
fn effect_commands(url: &str, run: &str, key: &str) -> Vec<String> {
    sql(url)
        .query(
            "SELECT command FROM estop_ledger WHERE run_id = $1 AND effect_key = $2 ORDER BY seq",
            &[&run, &key],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Every record about an effect carries its key in `effect_key` (migration 4): an effect held,
/// approved and released is found by it, and another effect's records are not. Records written
/// before the column existed get it when the migration runs (a database taken back to version
/// 3 by hand, then a node started on it).
#[test]
fn an_effects_records_are_found_by_its_key_and_older_records_get_it_at_migration() {
    let Some(url) = database() else { return };
    let mut d = node(&url);
    let (mut a, mut op) = (d.agent(), d.operator());
    assert_eq!(
        verdict(&admit(&mut a, "fx", "k2", "pay", json!({}))),
        "admitted"
    );
    assert_eq!(
        verdict(&admit(&mut a, "fx", "k1", "refund", json!({"usd": 2}))),
        "held"
    );
    ok(
        &mut op,
        json!({"op": "decide", "run": "fx", "key": "k1", "decision": "approve"}),
    );
    let k1 = effect_commands(&url, "fx", "k1");
    assert_eq!(k1.first().map(String::as_str), Some("admit"), "{k1:?}");
    assert!(k1.iter().any(|c| c == "decide"), "{k1:?}");
    assert_eq!(effect_commands(&url, "fx", "k2"), vec!["admit".to_string()]);
    d.kill9();
    sql(&url)
        .batch_execute(
            "DROP INDEX estop_ledger_effect; ALTER TABLE estop_ledger DROP COLUMN effect_key;
             DROP TABLE estop_secret; DELETE FROM estop_schema WHERE version >= 4",
        )
        .unwrap();
    d.spawn();
    assert_eq!(
        effect_commands(&url, "fx", "k1"),
        k1,
        "filled in at migration"
    );
    assert_eq!(effect_commands(&url, "fx", "k2"), vec!["admit".to_string()]);
}

/// A `hello` whose token lookup waits on the database holds up no other connection of the
/// node: the lookup is off the IO thread. (With it on the IO thread, an agent's hello — or a
/// slow database — stalled every connection of the node, an operator's cancel among them.)
#[test]
fn a_token_lookup_waiting_on_the_database_holds_up_no_other_connection() {
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixStream;
    let Some(url) = database() else { return };
    let a = node(&url);
    let line = |conn: &mut BufReader<UnixStream>, req: serde_json::Value| {
        conn.get_mut()
            .write_all(format!("{req}\n").as_bytes())
            .unwrap();
    };
    let answer = |conn: &mut BufReader<UnixStream>| {
        let mut got = String::new();
        conn.read_line(&mut got)
            .expect("an answer before the read timeout");
        serde_json::from_str::<serde_json::Value>(&got).unwrap()
    };
    let open = || {
        let s = UnixStream::connect(a.socket()).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .unwrap();
        BufReader::new(s)
    };
    let mut operator = open();
    line(
        &mut operator,
        json!({"id": 1, "op": "hello", "token": a.token("operator.token")}),
    );
    assert_eq!(answer(&mut operator)["ok"], true);
    // The registry locked: a lookup now waits until the lock is let go.
    let mut locker = sql(&url);
    let mut tx = locker.transaction().unwrap();
    tx.batch_execute("LOCK TABLE estop_token IN ACCESS EXCLUSIVE MODE")
        .unwrap();
    let mut agent = open();
    line(
        &mut agent,
        json!({"id": 1, "op": "hello", "token": a.token("agent.token")}),
    );
    let mut watch = sql(&url);
    let waiting = |watch: &mut postgres::Client| -> i64 {
        watch
            .query_one(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
                 WHERE c.relname = 'estop_token' AND NOT l.granted",
                &[],
            )
            .unwrap()
            .get(0)
    };
    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while waiting(&mut watch) == 0 {
        assert!(std::time::Instant::now() < until, "the hello never asked");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // The operator's connection is answered while the agent's lookup waits.
    line(
        &mut operator,
        json!({"id": 2, "op": "status", "run": "nope"}),
    );
    let st = answer(&mut operator);
    assert_eq!(st["error"]["code"], "not_found", "{st}");
    // ... and the agent's hello is still waiting (not answered by a lookup given up on).
    agent.get_ref().set_nonblocking(true).unwrap();
    let mut early = String::new();
    let still = agent.read_line(&mut early);
    assert!(
        still
            .as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock),
        "{still:?} {early}"
    );
    agent.get_ref().set_nonblocking(false).unwrap();
    tx.commit().unwrap();
    assert_eq!(answer(&mut agent)["ok"], true);
}

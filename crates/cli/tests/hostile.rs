//! Hostile input against the real daemon: malformed JSON, invalid UTF-8, deep nesting, oversize
//! lines, unknown ops, wrong roles, a slow client, thousands of idle connections and forged
//! SoundGate decision tags. No crash, bounded memory, a clear error for each, and nothing
//! half-applied (the ledger holds exactly the changes that were acknowledged).

mod common;

use common::{Daemon, Wire, admit, err_code, ok, verdict};
use estop_protocol::ServerLine;
use serde_json::json;
use std::io::{BufRead, BufReader, Write};

fn rss_kib(d: &Daemon) -> u64 {
    let pid = d.child.as_ref().unwrap().id();
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

fn ledger_len(d: &Daemon) -> usize {
    let mut op = d.operator();
    ok(&mut op, json!({"op": "ledger"}))["entries"]
        .as_array()
        .unwrap()
        .len()
}

fn error_code_of(c: &mut estop_server::client::Client) -> String {
    match c.read_line().unwrap() {
        ServerLine::Reply(r) => r.error.map(|e| e.code).unwrap_or_else(|| "ok".into()),
        e => panic!("{e:?}"),
    }
}

#[test]
fn hostile_input_gets_clear_errors_and_changes_nothing() {
    let d = Daemon::start();
    let mut a = d.agent();
    assert_eq!(
        verdict(&admit(&mut a, "r", "k", "pay", json!({}))),
        "admitted"
    );
    let before = ledger_len(&d);
    let deep = format!(
        "{{\"id\":9,\"op\":\"admit\",\"run\":\"r\",\"key\":\"d\",\"tool\":\"pay\",\"args\":{}1{}}}",
        "[".repeat(5000),
        "]".repeat(5000)
    );
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"{not json".to_vec(), "bad_json"),
        (b"[1,2,3]".to_vec(), "bad_json"),
        (b"\"just a string\"".to_vec(), "bad_json"),
        (vec![0xff, 0xfe, b'{', b'}'], "bad_json"),
        (b"{\"id\":1,\"op\":\"admit\",\"run\":\"r\",\"key\":\"x\",\"tool\":\"pay\",\"args\":{},\"args\":{}}".to_vec(), "invalid_field"),
        (b"{\"id\":2,\"op\":\"launch_missiles\"}".to_vec(), "unknown_op"),
        (b"{\"id\":3,\"op\":\"admit\",\"run\":\"\",\"key\":\"x\",\"tool\":\"pay\",\"args\":{}}".to_vec(), "invalid_field"),
        (b"{\"id\":4,\"op\":\"admit\",\"run\":\"r\\u0000\",\"key\":\"x\",\"tool\":\"pay\",\"args\":{}}".to_vec(), "invalid_field"),
        (b"{\"id\":5,\"op\":\"wait\",\"run\":\"r\",\"key\":\"k\",\"timeout_ms\":-1}".to_vec(), "invalid_field"),
        (b"{\"id\":6,\"op\":\"admit\",\"run\":\"r\",\"key\":\"x\",\"tool\":\"pay\",\"args\":1e999999}".to_vec(), "bad_json"),
        (deep.into_bytes(), "bad_json"),
        // Wrong roles: an agent can never approve, resume, pause, kill or mint tokens.
        (br#"{"id":7,"op":"decide","run":"r","key":"k","decision":"approve"}"#.to_vec(), "forbidden"),
        (br#"{"id":8,"op":"resume","run":"r"}"#.to_vec(), "forbidden"),
        (br#"{"id":9,"op":"kill","run":"r"}"#.to_vec(), "forbidden"),
        (br#"{"id":10,"op":"token","name":"evil","role":"operator"}"#.to_vec(), "forbidden"),
        (br#"{"id":11,"op":"ledger"}"#.to_vec(), "forbidden"),
    ];
    for (line, code) in &cases {
        a.send_raw(line).unwrap();
        let got = error_code_of(&mut a);
        assert!(
            got == *code || (*code == "bad_json" && got == "invalid_field"),
            "{}: got {got}, want {code}",
            String::from_utf8_lossy(&line[..line.len().min(80)])
        );
    }
    // Another agent's run looks like no run at all.
    let mut op = d.operator();
    let t = ok(
        &mut op,
        json!({"op": "token", "name": "mallory", "role": "agent"}),
    )["token"]
        .as_str()
        .unwrap()
        .to_string();
    let mut m = d.client_with(&t);
    assert_eq!(
        err_code(&mut m, json!({"op": "cancel", "run": "r"})),
        "not_found"
    );
    // A token it could guess is not one the gate sealed for that effect: refused before the
    // run is even looked up, so the answer says nothing of whether it exists.
    assert_eq!(
        err_code(
            &mut m,
            json!({"op": "start", "run": "r", "key": "k", "token": "1.1"})
        ),
        "bad_token"
    );
    // Before hello nothing but ping.
    let mut anon = estop_server::client::Client::connect(&d.socket()).unwrap();
    assert_eq!(
        err_code(
            &mut anon,
            json!({"op": "admit", "run": "r", "key": "z", "tool": "pay", "args": {}})
        ),
        "unauthenticated"
    );
    assert_eq!(
        err_code(&mut anon, json!({"op": "hello", "token": "forged"})),
        "unauthenticated"
    );
    // Nothing was half-applied: only the operator's token creation (one `token_create`
    // record) touched the ledger.
    assert_eq!(
        ledger_len(&d),
        before + 1,
        "hostile input changed the ledger"
    );
    assert_eq!(
        verdict(&admit(&mut a, "r", "k2", "pay", json!({}))),
        "admitted"
    );
}

#[test]
fn oversize_lines_slow_clients_and_idle_connections_are_bounded() {
    let d = Daemon::start_with(&["--connections-max", "5000"]);
    let rss0 = rss_kib(&d);
    // Oversize lines: discarded as they arrive, never buffered whole.
    let mut a = d.agent();
    let big = vec![b'x'; 4 << 20];
    for _ in 0..8 {
        a.send_raw(&big).unwrap();
        assert_eq!(error_code_of(&mut a), "line_too_long");
    }
    assert_eq!(
        verdict(&admit(&mut a, "r", "k", "pay", json!({}))),
        "admitted"
    );
    // A slow client dribbles a request byte by byte while another is served normally.
    let mut slow = std::os::unix::net::UnixStream::connect(d.socket()).unwrap();
    let line = br#"{"id":1,"op":"ping"}"#;
    for (i, b) in line.iter().enumerate() {
        slow.write_all(&[*b]).unwrap();
        if i % 4 == 0 {
            assert_eq!(
                verdict(&admit(&mut a, "r", &format!("s{i}"), "pay", json!({}))),
                "admitted"
            );
        }
    }
    slow.write_all(b"\n").unwrap();
    let mut r = BufReader::new(slow.try_clone().unwrap());
    let mut reply = String::new();
    r.read_line(&mut reply).unwrap();
    assert!(reply.contains("\"pong\":true"), "{reply}");
    // Thousands of idle connections.
    let mut idle = Vec::new();
    for _ in 0..3000 {
        idle.push(std::os::unix::net::UnixStream::connect(d.socket()).unwrap());
    }
    assert_eq!(
        verdict(&admit(&mut a, "r", "after-idle", "pay", json!({}))),
        "admitted"
    );
    let mut fresh = d.agent();
    assert_eq!(
        verdict(&admit(&mut fresh, "r2", "k", "pay", json!({}))),
        "admitted"
    );
    let rss1 = rss_kib(&d);
    println!(
        "daemon RSS: {rss0} KiB at start, {rss1} KiB with 3000 idle connections after 32 MiB of oversize lines"
    );
    assert!(
        rss1 < rss0 + 256 * 1024,
        "memory grew from {rss0} KiB to {rss1} KiB"
    );
    drop(idle);
    assert_eq!(
        verdict(&admit(&mut a, "r", "end", "pay", json!({}))),
        "admitted"
    );
}

#[test]
fn forged_soundgate_decision_tags_are_refused_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policy.toml"), common::POLICY).unwrap();
    let mut d = Daemon {
        dir,
        child: None,
        ready: String::new(),
        extra: vec![],
    };
    // Spawn with a secret in the child's environment only.
    let mut child = std::process::Command::new(common::bin())
        .args(["serve", "--soundgate-listen", "127.0.0.1:0", "--data"])
        .arg(d.data())
        .arg("--policy")
        .arg(d.data().join("policy.toml"))
        .env("ESTOP_SOUNDGATE_SECRET", "s3cret")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.starts_with("estop ready") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "daemon exited");
    }
    d.ready = line.trim().to_string();
    d.child = Some(child);
    let s = std::net::TcpStream::connect(d.ready_field("soundgate")).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut w = s;
    let mut call = |l: &str| -> serde_json::Value {
        w.write_all(format!("{l}\n").as_bytes()).unwrap();
        let mut reply = String::new();
        r.read_line(&mut reply).unwrap();
        serde_json::from_str(&reply).unwrap()
    };
    assert_eq!(
        call(r#"{"op":"submit","run_id":"r","effect_key":"send","needs_approval":true}"#)["verdict"],
        "held_for_approval"
    );
    let good_for_other_run =
        estop_protocol::soundgate::decision_tag_hex(b"s3cret", "other", "send", true);
    let good_reject = estop_protocol::soundgate::decision_tag_hex(b"s3cret", "r", "send", false);
    let wrong_secret = estop_protocol::soundgate::decision_tag_hex(b"guess", "r", "send", true);
    for mac in [
        String::new(),
        "00".repeat(32),
        good_for_other_run,
        good_reject,
        wrong_secret,
        "zz".into(),
    ] {
        let v = call(&format!(
            r#"{{"op":"decide","run_id":"r","effect_key":"send","approved":true,"mac":"{mac}"}}"#
        ));
        assert_eq!(v["verdict"], "error", "forged mac {mac:?} accepted: {v}");
        assert!(
            v["message"].as_str().unwrap().contains("unauthenticated"),
            "{v}"
        );
    }
    assert_eq!(
        call(r#"{"op":"decide","run_id":"r","effect_key":"send","approved":true}"#)["verdict"],
        "error"
    );
    // Still pending: nothing was applied.
    let mut op = d.operator();
    assert_eq!(
        ok(&mut op, json!({"op": "pending"}))["pending"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let good = estop_protocol::soundgate::decision_tag_hex(b"s3cret", "r", "send", true);
    assert_eq!(
        call(&format!(
            r#"{{"op":"decide","run_id":"r","effect_key":"send","approved":true,"mac":"{good}"}}"#
        ))["verdict"],
        "release"
    );
}

fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces): utime and stime are 14 and 15.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// Out of file descriptors, the daemon keeps serving the clients it has, makes a new one wait
/// (without spinning on the listener), says why in its log, and serves it once others leave.
#[test]
fn out_of_descriptors_new_clients_wait_and_are_served_once_others_leave() {
    let d = Daemon::start();
    let pid = d.child.as_ref().unwrap().id();
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    // Room for a few more connections (each holds its socket and a duplicate of it).
    let limit = open + 6;
    let status = std::process::Command::new("prlimit")
        .arg(format!("--pid={pid}"))
        .arg(format!("--nofile={limit}:{limit}"))
        .status()
        .expect("prlimit (util-linux) runs");
    assert!(status.success());

    let ping = |c: &mut std::os::unix::net::UnixStream| {
        c.write_all(b"{\"id\":1,\"op\":\"ping\"}\n").unwrap();
    };
    let replied = |c: &std::os::unix::net::UnixStream, wait_ms: u64| {
        c.set_read_timeout(Some(std::time::Duration::from_millis(wait_ms)))
            .unwrap();
        let mut line = String::new();
        BufReader::new(c).read_line(&mut line).is_ok() && line.contains("\"pong\":true")
    };
    let mut served = Vec::new();
    let waiting = loop {
        let mut c = std::os::unix::net::UnixStream::connect(d.socket()).unwrap();
        ping(&mut c);
        if !replied(&c, 2000) {
            break c;
        }
        served.push(c);
        assert!(served.len() <= 6, "the lowered limit never bit");
    };
    assert!(
        served.len() >= 2,
        "served {} before the limit",
        served.len()
    );

    // While the new client waits, the daemon does not spin on its listener.
    let before = cpu_ticks(pid);
    std::thread::sleep(std::time::Duration::from_secs(1));
    let spent = cpu_ticks(pid) - before;
    assert!(
        spent < 50,
        "the daemon spent {spent} ticks of CPU in one second while a client waited"
    );
    // The clients it has are still served.
    let mut first = served.remove(0);
    ping(&mut first);
    assert!(replied(&first, 5000));
    let log = std::fs::read_to_string(d.data().join("serve.log")).unwrap();
    assert!(log.contains("cannot accept connections"), "{log}");

    drop(first);
    drop(served);
    assert!(
        replied(&waiting, 10_000),
        "the waiting client was served once others left"
    );
}

/// Started with a low soft limit on open files (as many service managers do), the daemon raises
/// it to what its connections need, up to the hard limit, and warns when the hard limit is lower.
#[test]
fn the_open_file_limit_is_raised_at_start_and_a_low_hard_limit_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new("prlimit")
        .arg("--nofile=64:4096")
        .arg("--")
        .arg(common::bin())
        .args(["serve", "--allow-all", "--console", "off", "--data"])
        .arg(dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("prlimit (util-linux) runs");
    let mut ready = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut ready)
        .unwrap();
    assert!(ready.starts_with("estop ready"), "{ready}");
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", child.id())).unwrap();
    let files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .split_whitespace()
        .skip(3)
        .take(2)
        .collect::<Vec<_>>();
    assert_eq!(files, ["4096", "4096"], "{limits}");
    child.kill().unwrap();
    let mut log = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut log).unwrap();
    child.wait().unwrap();
    assert!(log.contains("open-file limit is 4096 (hard 4096)"), "{log}");
}

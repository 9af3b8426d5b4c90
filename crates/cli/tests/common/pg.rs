//! The PostgreSQL server the tests share (`scripts/postgres`, started once per test run; each
//! test gets a database of its own), and which store a suite runs on: a test target whose name
//! ends in `_postgres` (`e2e_postgres.rs`) runs every daemon of the suite as an
//! `estop serve --store` node on a fresh database instead of the embedded ledger.

use std::fs::File;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// Whether this test target runs its suite against PostgreSQL (decided by the target's name,
/// so one suite file is compiled into both targets and nothing is copied).
pub fn suite_on_postgres() -> bool {
    env!("CARGO_CRATE_NAME").ends_with("_postgres")
}

/// The URL of the shared test server's `postgres` database; `None`: skipped by request.
pub fn server() -> Option<&'static str> {
    static URL: OnceLock<Option<String>> = OnceLock::new();
    URL.get_or_init(|| {
        if std::env::var("ESTOP_TEST_SKIP_POSTGRES").is_ok_and(|v| v == "1") {
            eprintln!("ESTOP_TEST_SKIP_POSTGRES=1: skipping the PostgreSQL store's tests");
            return None;
        }
        Some(start_server())
    })
    .as_deref()
}

/// Starts the server for this test run (nextest runs each test in a process of its own: the
/// run is the parent process), or finds the one another test of the run started.
fn start_server() -> String {
    let run = std::os::unix::process::parent_id();
    let dir = std::env::temp_dir().join(format!("estop-test-pg-{run}"));
    let url_file = PathBuf::from(format!("{}.url", dir.display()));
    let lock = File::create(format!("{}.lock", dir.display())).unwrap();
    lock.lock().unwrap(); // Blocks while another test of the run starts it.
    if let Ok(url) = std::fs::read_to_string(&url_file) {
        return url;
    }
    let url = start_private(&dir, &[]);
    std::fs::write(&url_file, &url).unwrap();
    url
}

/// Starts a server of its own in `dir` (for a test that restarts or reconfigures it), with
/// `settings` (`name=value`) for postgres; stopped once the test run is gone. Its URL.
pub fn start_private(dir: &std::path::Path, settings: &[&str]) -> String {
    let run = std::os::unix::process::parent_id();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/postgres");
    let out = Command::new(script)
        .arg("start")
        .arg(dir)
        .arg(run.to_string())
        .env("ESTOP_PG_SETTINGS", settings.join(" "))
        .output()
        .expect("run scripts/postgres");
    assert!(
        out.status.success(),
        "scripts/postgres could not start PostgreSQL (set ESTOP_TEST_SKIP_POSTGRES=1 to skip these tests):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    stdout.lines().last().unwrap().trim().to_string()
}

/// A fresh database on the server at `base`; its URL.
pub fn database_on(base: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "estop_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    let mut admin = postgres::Client::connect(base, postgres::NoTls).unwrap();
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .unwrap();
    format!("{}/{name}", base.rsplit_once('/').unwrap().0)
}

/// A fresh database on the shared test server; its URL. `None`: skipped.
pub fn database() -> Option<String> {
    Some(database_on(server()?))
}

pub fn sql(url: &str) -> postgres::Client {
    postgres::Client::connect(url, postgres::NoTls).unwrap()
}

/// `scripts/postgres restart|stop DIR` for a server of a test's own (`start_private`).
pub fn control(verb: &str, dir: &std::path::Path) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/postgres");
    let out = Command::new(script).arg(verb).arg(dir).output().unwrap();
    assert!(
        out.status.success(),
        "scripts/postgres {verb}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Polls `query` (one bigint) on `url` until it gives `want`, for at most 30 s: a readiness
/// wait on the server's own view (a lock waited for, a session gone), never a sleep.
pub fn until(url: &str, query: &str, want: i64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut db = sql(url);
    loop {
        let got: i64 = db.query_one(query, &[]).unwrap().get(0);
        if got == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "`{query}` gave {got}, not {want}, for 30 s"
        );
        std::thread::yield_now();
    }
}

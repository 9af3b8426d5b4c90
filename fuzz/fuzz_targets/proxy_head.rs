//! The egress proxy's view of a request head: the bytes an agent sends are parsed as an
//! HTTP/1.1 head (httparse, what hyper's server uses), then the method and target become the
//! effect's tool and arguments (`proxy::request_args`: method normalised, userinfo refused,
//! secret query parameters redacted). Never a panic, and what is recorded holds:
//! the method upper case, no secret parameter's value, no userinfo, the digest of the query as
//! sent beside a redacted one.
#![no_main]

use estop_egress::proxy::{HttpMethod, HttpUri, REDACTED, normalised, redact_query, request_args};
use estop_egress::settings::Settings;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

fn settings() -> &'static Settings {
    static S: OnceLock<Settings> = OnceLock::new();
    S.get_or_init(|| {
        Settings::parse("[egress]\nsecret_params = [\"api_key\", \"sig\"]\n")
            .expect("the fuzz settings parse")
    })
}

fuzz_target!(|data: &[u8]| {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    let Ok(httparse::Status::Complete(len)) = req.parse(data) else {
        return;
    };
    let (Some(method), Some(target)) = (req.method, req.path) else {
        return;
    };
    let Ok(method) = HttpMethod::from_bytes(method.as_bytes()) else {
        return;
    };
    let Ok(uri) = target.parse::<HttpUri>() else {
        return;
    };
    let upper = normalised(&method);
    assert_eq!(upper.as_str(), method.as_str().to_ascii_uppercase());
    let Ok(args) = request_args(&method, &uri, &data[len..], settings()) else {
        return;
    };
    assert_eq!(args["method"].as_str(), Some(upper.as_str()));
    let authority = uri.authority().expect("an admitted request names its host");
    assert!(!authority.as_str().contains('@'), "userinfo admitted: {uri}");
    let query = args["query"].as_str().expect("a query string");
    let url = args["url"].as_str().expect("a url");
    if args.get("query_sha256").is_some() {
        // Redacted: no secret parameter keeps a value, and redacting again changes nothing.
        assert!(query.contains(REDACTED), "{query}");
        assert!(url.ends_with(query), "{url} / {query}");
        let again = redact_query(query, &settings().secret_params);
        assert_eq!(again.as_deref(), Some(query));
    } else {
        assert_eq!(query, uri.query().unwrap_or(""));
    }
});

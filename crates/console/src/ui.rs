//! The web console's files, embedded in the binary: plain HTML, CSS and JavaScript, no build
//! step. The OpenAPI description is served next to them.

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("../ui/index.html");
const SCRIPT: &str = include_str!("../ui/app.js");
const STYLE: &str = include_str!("../ui/app.css");
const FAVICON: &str = include_str!("../ui/favicon.svg");
const OPENAPI: &str = include_str!("../../../docs/openapi.yaml");

fn typed(body: &'static str, content_type: &'static str) -> Response {
    let mut r = body.into_response();
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

pub async fn index() -> Response {
    typed(INDEX, "text/html; charset=utf-8")
}

pub async fn script() -> Response {
    typed(SCRIPT, "text/javascript; charset=utf-8")
}

pub async fn style() -> Response {
    typed(STYLE, "text/css; charset=utf-8")
}

pub async fn favicon() -> Response {
    typed(FAVICON, "image/svg+xml")
}

pub async fn openapi() -> Response {
    typed(OPENAPI, "application/yaml; charset=utf-8")
}

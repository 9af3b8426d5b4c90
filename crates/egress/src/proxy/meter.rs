//! Model-call metering: the proxy's own `/v1/…` (origin-form requests to
//! `http://127.0.0.1:3128`, which `OPENAI_BASE_URL` names inside the sandbox) is an
//! OpenAI-compatible endpoint that forwards to the configured provider. Every call is an
//! effect (`model.call`) admitted before it is sent, with its worst case (prompt estimate +
//! `max_tokens`) as the admission's `reserve`; its completion carries the `cost`: the usage the
//! provider reports (uncached input, cached input, output, at the configured prices), or
//! `max(observed, reservation)` when a stream is cut or no usage is reported. The budget itself
//! is the gate's (`max_spend` / `max_tokens` of the run, set from `budget_usd` /
//! `budget_tokens` when `estop run` creates it): the gate refuses a call that does not fit,
//! counts a child run's spend against its parents, keeps it across restarts, and fences the run
//! when its settled spend reaches a limit; the proxy cuts a stream the moment the run stops.
//! docs/EGRESS.md, "Model calls"; docs/PROTOCOL.md, "Model budget".

use super::until_stopped;
use super::{Effect, Proxy, Reply, full, refusal, stopped};
use crate::settings::ModelSettings;
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::{Request, Response, StatusCode};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;

impl ModelSettings {
    fn cost(&self, usage: &Usage) -> Charge {
        let micros = usage.uncached as f64 * self.input
            + usage.cached as f64 * self.cached_input
            + usage.output as f64 * self.output;
        Charge {
            usd_micros: micros.ceil() as u64,
            tokens: usage.uncached + usage.cached + usage.output,
        }
    }
}

/// Tokens of one call, as reported (or estimated).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub uncached: u64,
    pub cached: u64,
    pub output: u64,
}

/// What a call costs in each budgeted dimension.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Charge {
    pub usd_micros: u64,
    pub tokens: u64,
}

impl Charge {
    fn max(self, o: Charge) -> Charge {
        Charge {
            usd_micros: self.usd_micros.max(o.usd_micros),
            tokens: self.tokens.max(o.tokens),
        }
    }

    /// As the gate reads it (`reserve`, `cost`).
    fn json(self) -> Value {
        json!({"usd_micros": self.usd_micros, "tokens": self.tokens})
    }
}

/// One call, as planned before it is sent.
struct Plan {
    stream: bool,
    prompt_estimate: u64,
    max_tokens: u64,
    reserve: Charge,
    upstream_path: String,
}

/// Reads the call, forces what metering needs into it (`stream_options.include_usage` on a
/// stream, `max_tokens` when no output bound is named), and prices its worst case.
fn plan(m: &ModelSettings, path: &str, doc: &mut Value) -> Result<Plan, String> {
    let Some(obj) = doc.as_object_mut() else {
        return Err("the body is not a JSON object".into());
    };
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    if stream {
        let opts = obj.entry("stream_options").or_insert_with(|| json!({}));
        let Some(opts) = opts.as_object_mut() else {
            return Err("stream_options is not an object".into());
        };
        opts.insert("include_usage".into(), Value::Bool(true));
    }
    let bound = ["max_tokens", "max_completion_tokens", "max_output_tokens"]
        .iter()
        .find_map(|k| obj.get(*k).map(|v| (k, v.clone())));
    let max_tokens = match bound {
        Some((k, v)) => v.as_u64().ok_or(format!("{k} is not a whole number"))?,
        None => {
            obj.insert("max_tokens".into(), json!(m.max_tokens_default));
            m.max_tokens_default
        }
    };
    // About four bytes a token: an estimate for the reservation only; usage settles it.
    let prompt = ["messages", "input", "prompt"]
        .iter()
        .find_map(|k| obj.get(*k))
        .map_or(0, |v| v.to_string().len() as u64);
    let prompt_estimate = prompt.div_ceil(4);
    let reserve = m.cost(&Usage {
        uncached: prompt_estimate,
        cached: 0,
        output: max_tokens,
    });
    let rest = path.strip_prefix("/v1").unwrap_or(path);
    Ok(Plan {
        stream,
        prompt_estimate,
        max_tokens,
        reserve,
        upstream_path: format!("{}{rest}", m.base_path),
    })
}

/// The usage a provider reports: chat completions (`prompt_tokens`, `completion_tokens`,
/// `prompt_tokens_details.cached_tokens`) or responses (`input_tokens`, `output_tokens`,
/// `input_tokens_details.cached_tokens`).
pub fn usage(u: &Value) -> Option<Usage> {
    let input = u["prompt_tokens"].as_u64().or(u["input_tokens"].as_u64())?;
    let output = u["completion_tokens"]
        .as_u64()
        .or(u["output_tokens"].as_u64())?;
    let cached = u["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .or(u["input_tokens_details"]["cached_tokens"].as_u64())
        .unwrap_or(0)
        .min(input);
    Some(Usage {
        uncached: input - cached,
        cached,
        output,
    })
}

fn bad(message: &str) -> Reply {
    refusal(
        StatusCode::BAD_REQUEST,
        json!({"verdict": "refused", "reason": "bad_request", "message": message}),
    )
}

/// Serves one call to the metered endpoint.
pub async fn call(proxy: Arc<Proxy>, req: Request<Incoming>) -> Reply {
    let Some(m) = proxy.settings.model.clone() else {
        return refusal(
            StatusCode::NOT_FOUND,
            json!({"verdict": "refused", "reason": "no_model_provider",
            "message": "this sandbox has no model provider ([egress.model] is not configured)"}),
        );
    };
    let (parts, body) = req.into_parts();
    let Ok(body) = Limited::new(body, proxy.settings.body_bytes_max)
        .collect()
        .await
    else {
        return bad("the body is over body_bytes_max or broken");
    };
    let Ok(mut doc) = serde_json::from_slice::<Value>(&body.to_bytes()) else {
        return bad("the body is not JSON");
    };
    let plan = match plan(&m, parts.uri.path(), &mut doc) {
        Ok(p) => p,
        Err(e) => return bad(&e),
    };
    let seq = proxy.seq.fetch_add(1, Ordering::Relaxed);
    let effect = Effect {
        tool: "model.call".into(),
        key: format!("model:{}:{seq}", proxy.nonce),
        args: json!({"model": doc["model"], "path": plan.upstream_path, "scheme": m.scheme,
            "host": m.host, "port": m.port, "stream": plan.stream,
            "prompt_tokens_estimate": plan.prompt_estimate, "max_tokens": plan.max_tokens,
            "reserved_usd_micros": plan.reserve.usd_micros,
            "reserved_tokens": plan.reserve.tokens}),
        request_body: None,
    };
    // The gate counts the reservation on the run and every ancestor, or refuses the call
    // (`budget`, naming the dimension and the run whose limit it would pass).
    let token = match proxy.admit_with(&effect, Some(plan.reserve.json())).await {
        Ok(t) => t,
        Err(reply) => return *reply,
    };
    let call = Call {
        proxy,
        m,
        plan,
        effect,
        token,
    };
    call.send(doc).await
}

/// The gate refused a call's reservation: `budget` names the dimension and the run whose
/// limit it would pass (this run or an ancestor).
pub(crate) fn over_budget(key: &str, budget: &Value) -> Reply {
    let dimension = budget["dimension"].as_str().unwrap_or("?");
    let run = budget["run"].as_str().unwrap_or("?");
    refusal(
        StatusCode::FORBIDDEN,
        json!({"verdict": "refused", "reason": "budget", "dimension": dimension,
        "run": run, "key": key, "limit": budget["limit"], "used": budget["used"],
        "message": format!("the model budget ({dimension}) of run {run} cannot cover this call; nothing was sent"),
        "what_to_do": "stop, or ask for a smaller max_tokens"}),
    )
}

/// An admitted call, from the dial to its settlement.
struct Call {
    proxy: Arc<Proxy>,
    m: ModelSettings,
    plan: Plan,
    effect: Effect,
    token: String,
}

impl Call {
    async fn send(self, doc: Value) -> Reply {
        let (mut sender, _) = match self.proxy.dial(&self.effect).await {
            Ok(s) => s,
            Err((reply, outcome, error)) => {
                // Not sent: recorded as a failed call (started only to be settled at once, so
                // its reservation is released), unless the gate refuses the start (a stop).
                if self.proxy.begin(&self.effect, &self.token).await.is_ok() {
                    self.finish(outcome, None, 0, &error, 0).await;
                }
                return reply;
            }
        };
        // The commit point: the connection is ready, the call is written next.
        if let Err(reply) = self.proxy.begin(&self.effect, &self.token).await {
            return *reply;
        }
        let mut up = Request::builder()
            .method(hyper::Method::POST)
            .uri(&self.plan.upstream_path)
            .body(http_body_util::Full::new(Bytes::from(doc.to_string())))
            .expect("a path and a body");
        let h = up.headers_mut();
        let authority = format!("{}:{}", self.m.host, self.m.port);
        h.insert(
            hyper::header::HOST,
            HeaderValue::from_str(&authority).expect("a host"),
        );
        h.insert(
            hyper::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        // The provider's key comes from the credential store, never from the agent.
        for (name, value) in
            self.proxy
                .credentials
                .for_request(&self.m.scheme, &self.m.host, self.m.port)
        {
            h.insert(name.clone(), value.clone());
        }
        let mut fence = self.proxy.fence.clone();
        let res = tokio::select! {
            r = sender.send(up, &self.m.scheme) => r,
            _ = until_stopped(&mut fence) => {
                self.finish("unknown", None, 0, "cut: the run was stopped", 0).await;
                return stopped(&self.proxy.run, &self.effect.key);
            }
        };
        let res = match res {
            Ok(r) => r,
            Err(e) => {
                let msg = format!("the provider: {e}");
                let reply = self.proxy.failed(&self.effect, msg.clone()).0;
                self.finish("unknown", None, 0, &msg, 0).await;
                return reply;
            }
        };
        if self.plan.stream && res.status().is_success() {
            return self.relay(res);
        }
        self.whole(res).await
    }

    /// A whole answer: read, settled on its `usage` (the reservation when there is none).
    async fn whole(self, res: Response<Incoming>) -> Reply {
        let (rparts, rbody) = res.into_parts();
        let mut fence = self.proxy.fence.clone();
        let read = Limited::new(rbody, self.proxy.settings.response_bytes_max).collect();
        let bytes = tokio::select! {
            b = read => b.map(|b| b.to_bytes()),
            _ = until_stopped(&mut fence) => {
                self.finish("unknown", None, 0, "cut: the run was stopped", 0).await;
                return stopped(&self.proxy.run, &self.effect.key);
            }
        };
        let Ok(bytes) = bytes else {
            let msg = "the provider's answer broke off".to_string();
            let reply = self.proxy.failed(&self.effect, msg.clone()).0;
            self.finish("unknown", None, 0, &msg, 0).await;
            return reply;
        };
        let reported = serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|v| usage(&v["usage"]));
        let status = rparts.status.as_u16();
        self.finish("ok", reported, 0, "", status).await;
        let mut reply = Response::new(full(bytes));
        *reply.status_mut() = rparts.status;
        if let Some(ct) = rparts.headers.get(hyper::header::CONTENT_TYPE) {
            reply
                .headers_mut()
                .insert(hyper::header::CONTENT_TYPE, ct.clone());
        }
        reply
            .headers_mut()
            .insert("x-estop-verdict", HeaderValue::from_static("admitted"));
        reply
    }

    /// A stream: relayed chunk by chunk as it arrives, its `data:` lines read for the usage
    /// chunk and the content seen; settled when it ends, breaks or the run stops (then it is
    /// cut at once).
    fn relay(self, res: Response<Incoming>) -> Reply {
        let (rparts, mut rbody) = res.into_parts();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
        tokio::spawn(async move {
            let mut sse = Sse::default();
            let mut fence = self.proxy.fence.clone();
            let end = loop {
                let frame = tokio::select! {
                    f = rbody.frame() => f,
                    _ = until_stopped(&mut fence) => break Some("cut: the run was stopped"),
                };
                match frame {
                    None => break None,
                    Some(Err(_)) => break Some("the provider's stream broke off"),
                    Some(Ok(f)) => {
                        let Ok(data) = f.into_data() else { continue };
                        sse.feed(&data);
                        if tx.send(Ok(data)).await.is_err() {
                            break Some("the agent hung up mid-stream");
                        }
                    }
                }
            };
            if let Some(why) = end {
                let _ = tx.try_send(Err(std::io::Error::other(why)));
            }
            let (outcome, error) = match end {
                None => ("ok", ""),
                Some(why) => ("unknown", why),
            };
            let usage = if end.is_none() { sse.usage } else { None };
            let status = rparts.status.as_u16();
            self.finish(outcome, usage, sse.output_bytes, error, status)
                .await;
        });
        let mut reply = Response::new(BodyExt::boxed(super::Channel(rx)));
        *reply.status_mut() = rparts.status;
        let h = reply.headers_mut();
        h.insert(
            hyper::header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert("x-estop-verdict", HeaderValue::from_static("admitted"));
        reply
    }

    /// Completes the effect with what it cost and why: the gate releases the reservation,
    /// charges the cost on the run and every ancestor, and fences a run whose limit it reaches.
    async fn finish(
        &self,
        outcome: &str,
        reported: Option<Usage>,
        output_bytes: u64,
        error: &str,
        status: u16,
    ) {
        let sent = outcome != "error";
        let (charge, basis) = match reported {
            Some(u) => (self.m.cost(&u), "usage"),
            None if !sent => (Charge::default(), "not_sent"),
            None => {
                let observed = self.m.cost(&Usage {
                    uncached: self.plan.prompt_estimate,
                    cached: 0,
                    output: output_bytes.div_ceil(4),
                });
                (observed.max(self.plan.reserve), "reservation")
            }
        };
        let result = json!({"status": status, "usage": reported.map(|u| json!({
            "uncached_input": u.uncached, "cached_input": u.cached, "output": u.output})),
            "charged_usd_micros": charge.usd_micros, "charged_tokens": charge.tokens,
            "basis": basis});
        eprintln!(
            "estop run: {} charged {} µUSD {} tokens ({basis})",
            self.effect.key, charge.usd_micros, charge.tokens
        );
        let mut complete = json!({"op": "complete", "run": self.proxy.run, "key": self.effect.key,
            "token": self.token, "outcome": outcome, "result": result, "cost": charge.json()});
        if !error.is_empty() {
            complete["error"] = json!(error);
        }
        // Not completed (the gate unreachable), the reservation stays counted: the worst case.
        if let Err(e) = self.proxy.gate.call(complete).await {
            eprintln!("estop run: completing {}: {e:#}", self.effect.key);
        }
    }
}

/// Reads a server-sent-event stream as it passes: the usage chunk, and the bytes of content.
#[derive(Default)]
struct Sse {
    line: Vec<u8>,
    usage: Option<Usage>,
    output_bytes: u64,
}

impl Sse {
    fn feed(&mut self, data: &[u8]) {
        for &b in data {
            if b != b'\n' {
                // A line longer than any chunk a provider sends is not read (but relayed).
                if self.line.len() < 1 << 20 {
                    self.line.push(b);
                }
                continue;
            }
            let line = std::mem::take(&mut self.line);
            let Some(json) = line.strip_prefix(b"data:") else {
                continue;
            };
            let Ok(v) = serde_json::from_slice::<Value>(json.trim_ascii()) else {
                continue;
            };
            if let Some(u) = usage(&v["usage"]) {
                self.usage = Some(u);
            }
            for c in v["choices"].as_array().into_iter().flatten() {
                let text = c["delta"]["content"].as_str().unwrap_or_default();
                self.output_bytes += text.len() as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::ModelFile;

    fn settings(budget_usd: Option<f64>, budget_tokens: Option<u64>) -> ModelSettings {
        ModelSettings::from_file(ModelFile {
            provider: "https://api.example.com/v1/".into(),
            budget_usd,
            budget_tokens,
            usd_per_mtok_input: 1.0,
            usd_per_mtok_cached_input: Some(0.5),
            usd_per_mtok_output: 4.0,
            max_tokens_default: Some(100),
        })
        .unwrap()
    }

    #[test]
    fn a_call_is_planned_with_usage_forced_and_its_worst_case_priced() {
        let m = settings(None, None);
        assert_eq!(
            (m.host.as_str(), m.port, m.base_path.as_str()),
            ("api.example.com", 443, "/v1")
        );
        let mut doc = json!({"model": "x", "stream": true, "messages": [{"content": "abcd"}]});
        let p = plan(&m, "/v1/chat/completions", &mut doc).unwrap();
        assert_eq!(doc["stream_options"]["include_usage"], true);
        assert_eq!(doc["max_tokens"], 100, "the default bound is sent");
        assert_eq!(p.upstream_path, "/v1/chat/completions");
        let est = doc["messages"].to_string().len().div_ceil(4) as u64;
        assert_eq!(
            p.reserve,
            Charge {
                usd_micros: est + 400,
                tokens: est + 100
            }
        );
        let mut doc = json!({"stream": true, "stream_options": {"include_usage": false},
            "max_completion_tokens": 7, "input": "hi"});
        let p = plan(&m, "/v1/responses", &mut doc).unwrap();
        assert_eq!(
            doc["stream_options"]["include_usage"], true,
            "forced even when refused"
        );
        assert_eq!((p.max_tokens, doc.get("max_tokens")), (7, None));
        for bad in [
            json!([1]),
            json!({"max_tokens": -1}),
            json!({"stream": true, "stream_options": 1}),
        ] {
            assert!(plan(&m, "/v1/x", &mut bad.clone()).is_err(), "{bad}");
        }
    }

    #[test]
    fn usage_is_read_in_both_shapes_and_a_cut_call_charges_the_larger_per_dimension() {
        let chat = json!({"prompt_tokens": 10, "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 4}});
        let responses = json!({"input_tokens": 10, "output_tokens": 3,
            "input_tokens_details": {"cached_tokens": 4}});
        let want = Usage {
            uncached: 6,
            cached: 4,
            output: 3,
        };
        assert_eq!((usage(&chat), usage(&responses)), (Some(want), Some(want)));
        assert_eq!(usage(&Value::Null), None);
        assert_eq!(
            Charge {
                usd_micros: 1,
                tokens: 9
            }
            .max(Charge {
                usd_micros: 5,
                tokens: 2
            }),
            Charge {
                usd_micros: 5,
                tokens: 9
            },
            "a cut stream is charged the larger of observed and reserved, per dimension"
        );
    }

    #[test]
    fn the_stream_reader_finds_usage_and_content_across_chunk_boundaries() {
        let mut sse = Sse::default();
        let text = "data: {\"choices\":[{\"delta\":{\"content\":\"Hello\"}}]}\n\n\
                    data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n";
        for piece in text.as_bytes().chunks(7) {
            sse.feed(piece);
        }
        assert_eq!(sse.output_bytes, 5);
        assert_eq!(
            sse.usage,
            Some(Usage {
                uncached: 2,
                cached: 0,
                output: 1
            })
        );
    }
}

//! Context compaction at the budget's steer stage: a pure function of the journalled context
//! and one number recorded in the trajectory's record (`Pointers::compacted_before`), so a
//! resumed trajectory sends exactly the context the one before it sent. No model call: tool
//! results older than the last [`KEEP_TURNS`] turns are sent as a short marker naming their
//! size and where the full text is (the journal keeps every message as it was). Nothing else
//! changes: the system prompt, the task, every user and assistant message, and every tool
//! message (its `tool_call_id` kept, so each assistant tool call still has the message that
//! answers it, as providers require) stay where they are.

use crate::chat::{Message, Role};

/// Turns kept whole at the end of the context: a turn is an assistant message and what
/// follows it up to the next one (its tool results, any interrupt or notice).
pub const KEEP_TURNS: usize = 3;

/// A tool result at most this long is sent as it is: its marker would be no shorter.
pub const MARKER_MIN_BYTES: usize = 256;

/// Where the last `keep_turns` turns of `context` begin: the index of the `keep_turns`-th
/// assistant message from the end; 0 (nothing to compact) when there are not that many.
pub fn boundary(context: &[Message], keep_turns: usize) -> u64 {
    if keep_turns == 0 {
        return context.len() as u64;
    }
    context
        .iter()
        .enumerate()
        .rev()
        .filter(|(_, m)| m.role == Role::Assistant)
        .nth(keep_turns - 1)
        .map_or(0, |(i, _)| i as u64)
}

/// The context as sent to the model: each tool result before `before` (a context index) longer
/// than [`MARKER_MIN_BYTES`] replaced by its marker; everything else as journalled.
pub fn compacted(context: &[Message], before: u64) -> Vec<Message> {
    context
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let long = m.content.as_deref().map_or(0, str::len);
            if (i as u64) < before && m.role == Role::Tool && long > MARKER_MIN_BYTES {
                Message {
                    content: Some(marker(long, i)),
                    ..m.clone()
                }
            } else {
                m.clone()
            }
        })
        .collect()
}

/// What the model reads in place of a compacted tool result.
pub fn marker(bytes: usize, index: usize) -> String {
    format!(
        "[compacted at the budget's steer stage: this tool result was {bytes} bytes; its full \
         text is in the trajectory's journal (context message {index})]"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::ToolCall;

    fn assistant_calling(id: &str) -> Message {
        Message {
            role: Role::Assistant,
            content: None,
            tool_calls: vec![ToolCall::new(id, "fetch", "{}")],
            tool_call_id: None,
        }
    }

    /// system, task, then `turns` turns each of one call and its long result.
    fn context(turns: usize) -> Vec<Message> {
        let mut c = vec![Message::system("be brief"), Message::user("the task")];
        for t in 0..turns {
            let id = format!("c{t}");
            c.push(assistant_calling(&id));
            c.push(Message::tool(&id, format!("{t}").repeat(1000)));
        }
        c
    }

    #[test]
    fn the_boundary_is_the_start_of_the_last_turns() {
        let c = context(5);
        // assistants at 2, 4, 6, 8, 10
        assert_eq!(boundary(&c, 3), 6);
        assert_eq!(boundary(&c, 5), 2);
        assert_eq!(boundary(&c, 6), 0, "fewer turns than kept: nothing");
        assert_eq!(boundary(&c, 1), 10);
        assert_eq!(boundary(&context(0), 3), 0);
    }

    /// Only long tool results before the boundary change; each keeps its `tool_call_id`, so
    /// every assistant tool call still has its answer; the system prompt, the task and the
    /// last turns are as journalled; the same input gives the same output.
    #[test]
    fn only_old_tool_results_become_markers_and_every_call_keeps_its_answer() {
        let mut c = context(5);
        c.push(Message::tool("short", "ok".into()));
        let before = boundary(&c, 3);
        let out = compacted(&c, before);
        assert_eq!(out.len(), c.len());
        assert_eq!(out[..2], c[..2], "system prompt and task untouched");
        assert_eq!(
            out[before as usize..],
            c[before as usize..],
            "last turns whole"
        );
        for (i, (o, m)) in out.iter().zip(&c).enumerate() {
            assert_eq!(
                (o.role, &o.tool_call_id, &o.tool_calls),
                (m.role, &m.tool_call_id, &m.tool_calls)
            );
            if i == 3 || i == 5 {
                assert_eq!(o.content.as_deref(), Some(marker(1000, i).as_str()));
            } else {
                assert_eq!(o, m, "message {i}");
            }
        }
        for a in out.iter().filter(|m| m.role == Role::Assistant) {
            for call in &a.tool_calls {
                assert!(
                    out.iter()
                        .any(|m| m.tool_call_id.as_deref() == Some(&call.id))
                );
            }
        }
        assert_eq!(compacted(&c, before), out);
        assert_eq!(compacted(&c, 0), c, "nothing recorded: nothing compacted");
        let short = vec![
            Message::system("s"),
            Message::tool("x", "y".repeat(MARKER_MIN_BYTES)),
        ];
        assert_eq!(
            compacted(&short, 9),
            short,
            "a short result is sent as it is"
        );
    }
}

"""A user task for tests/integration/test_agentic_e2e.py: the calc task, but its environment answers
every model turn (so even a barely trained model has episodes of task.max_turns turns) through a
tool that misbehaves by the turn's text: it raises, returns a huge output, or echoes the digits.
Deterministic by text, so the same episode alone or in a batch gets the same replies."""

from megatron_rz.rl.agentic import CalcTask, ToolEnv


def flaky(text: str) -> str:
    if len(text) % 3 == 0:
        raise RuntimeError("flaky tool failed")
    if len(text) % 3 == 1:
        return "9" * 1_000_000
    return "".join(c for c in text if c.isdigit()) or "0"


class AlwaysReply(ToolEnv):
    def env_response(self, problem, turns, state):
        out, status = self.worker.call("flaky", turns[-1])
        state["tool_calls"] += 1
        state["statuses"].append(status)
        return self.reply.format(out)


def make_task(cfg):
    task = CalcTask(cfg)
    task.env.close()
    task.env = AlwaysReply([flaky], max_turns=cfg.max_turns, timeout_s=cfg.tool_timeout_s,
                           max_chars=cfg.tool_output_chars, answer=lambda p: p.row["product"])
    return task

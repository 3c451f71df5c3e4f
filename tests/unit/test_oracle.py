"""The oracle teacher's answers: Aider's ``whole`` and ``diff`` formats written from a known file and fix, read back
by Aider's own parsers (from its venv), the task found in a conversation, the decoy-first answers of multi-turn
trajectories, and the server's vLLM-shaped replies."""

from __future__ import annotations

import ast
import json
import subprocess

import pytest
from fastapi.testclient import TestClient

from aitlrt.common.model import prepare_bundled_model
from aitlrt.rollout.agents.aider import aider_venv
from aitlrt.tasks.feedback import HEADER
from aitlrt.tasks.task import task_from_row
from aitlrt.warmstart.oracle import (
    DECOY_COMMENT,
    DONE,
    EDIT_FORMATS,
    FENCES,
    OracleFile,
    OracleTask,
    answer,
    decoy,
    edit_block,
    feedback_turn,
    identify,
    listed,
    render,
    search_replace,
)
from aitlrt.warmstart.oracle_server import OracleResponder, create_app, fix_patch, oracle_task

BEFORE = """\
def area(w, h):
    return w + h


def perimeter(w, h):
    \"\"\"The length around.\"\"\"
    return 2 * (w + h)


def total(items):
    n = 0
    for item in items:
        n += 1
    return n


def count(items):
    n = 0
    for item in items:
        n += 1
    return n
"""
# Fixes area() and total() (whose body is the same as count()'s: the search needs context to be unique), and
# appends a function after the last line.
AFTER = (
    BEFORE.replace("return w + h", "return w * h").replace(
        "def total(items):\n    n = 0\n    for item in items:\n        n += 1",
        "def total(items):\n    n = 0\n    for item in items:\n        n += item",
    )
    + "\n\ndef mean(items):\n    return total(items) / count(items)\n"
)

# Aider's own reading of an answer: its parsers, then its replacement of each block in turn, on files in a folder.
APPLY = """
import json, sys, tempfile
from pathlib import Path
from aider.coders.editblock_coder import do_replace, find_original_update_blocks
from aider.coders.wholefile_coder import WholeFileCoder

job = json.load(sys.stdin)
fence, files = tuple(job["fence"]), job["files"]
with tempfile.TemporaryDirectory() as root:
    for path, text in files.items():
        (Path(root) / path).parent.mkdir(parents=True, exist_ok=True)
        (Path(root) / path).write_text(text)
    if job["format"] == "whole":
        coder = WholeFileCoder.__new__(WholeFileCoder)
        coder.fence, coder.root, coder.abs_root_path_cache = fence, root, {}
        coder.get_multi_response_content_in_progress = lambda: job["answer"]
        coder.get_inchat_relative_files = lambda: list(files)
        for path, _, lines in coder.get_edits():
            (Path(root) / path).write_text("".join(lines))
    else:
        for path, search, replace in find_original_update_blocks(job["answer"], fence, list(files)):
            full = Path(root) / path
            new = do_replace(str(full), full.read_text(), search, replace, fence)
            assert new, f"no match for {search!r}"
            full.write_text(new)
    print(json.dumps({path: (Path(root) / path).read_text() for path in files}))
"""


def aider_applies(text: str, edit_format: str, files: dict[str, str], fence=FENCES[0]) -> dict[str, str]:
    """The files after Aider parsed and applied ``text`` (in its own venv)."""
    job = json.dumps({"answer": text, "format": edit_format, "files": files, "fence": fence})
    done = subprocess.run(
        [str(aider_venv() / "bin" / "python"), "-c", APPLY], input=job, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_whole_format_is_each_changed_file_in_full_under_its_path():
    files = [OracleFile("pkg/geo.py", BEFORE, AFTER)]
    text = render(files, "whole")
    assert text == f"pkg/geo.py\n```\n{AFTER}```\n"
    assert aider_applies(text, "whole", {"pkg/geo.py": BEFORE}) == {"pkg/geo.py": AFTER}
    fence = ("<source>", "</source>")  # what Aider uses when a file has lines starting with ```
    assert render(files, "whole", fence) == f"pkg/geo.py\n<source>\n{AFTER}</source>\n"


def test_diff_format_has_one_block_per_hunk_with_the_least_context_that_is_unique():
    blocks = search_replace(BEFORE, AFTER, "pkg/geo.py")
    assert blocks == [
        ("    return w + h\n", "    return w * h\n"),
        # "        n += 1" is in total() and count(): one line above is still ambiguous, the def makes it unique
        (
            "def total(items):\n    n = 0\n    for item in items:\n        n += 1\n",
            "def total(items):\n    n = 0\n    for item in items:\n        n += item\n",
        ),
        # an insertion needs a non-blank search: the file's last lines ("return n" alone is also in total())
        (
            "        n += 1\n    return n\n",
            "        n += 1\n    return n\n\n\ndef mean(items):\n    return total(items) / count(items)\n",
        ),
    ]
    for search, _ in blocks[:2]:
        assert BEFORE.count(search) == 1
    text = render([OracleFile("pkg/geo.py", BEFORE, AFTER)], "diff")
    assert text.startswith("pkg/geo.py\n```python\n<<<<<<< SEARCH\n    return w + h\n=======\n")
    assert text.count("<<<<<<< SEARCH") == 3 and text.count(">>>>>>> REPLACE\n```\n") == 3
    assert aider_applies(text, "diff", {"pkg/geo.py": BEFORE}) == {"pkg/geo.py": AFTER}


def test_diff_searches_match_the_file_as_the_blocks_before_left_it():
    filler = "".join(f"f{i} = {i}\n" for i in range(8))
    before, after = f"a = 0\n{filler}b = 1\n", f"b = 1\n{filler}b = 2\n"
    # "b = 1" is unique in the original file, but not once the first block has made another one
    assert search_replace(before, after, "m.py") == [("a = 0\n", "b = 1\n"), ("f7 = 7\nb = 1\n", "f7 = 7\nb = 2\n")]
    assert aider_applies(render([OracleFile("m.py", before, after)], "diff"), "diff", {"m.py": before}) == {
        "m.py": after
    }
    # Aider drops a last blank line of a block, and a first line ending with the file's name (taken for the path):
    # such blocks get other context
    cases = {
        ("x = 1\ny = 2\n", "x = 1\n\ny = 2\n"): [("y = 2\n", "\ny = 2\n")],
        ("x = 0\n# see m.py\n", "x = 0\n# see m.py too\n"): [("x = 0\n# see m.py\n", "x = 0\n# see m.py too\n")],
    }
    for (before, after), blocks in cases.items():
        assert search_replace(before, after, "m.py") == blocks
        assert aider_applies(render([OracleFile("m.py", before, after)], "diff"), "diff", {"m.py": before}) == {
            "m.py": after
        }


def test_new_files_deleted_files_and_marker_lines():
    assert search_replace("", "print(1)\n", "new.py") == [("", "print(1)\n")]
    with pytest.raises(ValueError, match="deletes"):
        render([OracleFile("gone.py", "x = 1\n", "")], "diff")
    with pytest.raises(ValueError, match="marker"):
        search_replace("a = 1\n", "a = '''\n=======\n'''\n", "m.py")
    with pytest.raises(ValueError, match="edit formats"):
        render([OracleFile("m.py", "a\n", "b\n")], "udiff")


def _files_message(listings: dict[str, str], fence=FENCES[0]) -> dict[str, str]:
    """Aider's message of the files in the chat (``Coder.get_files_content``)."""
    body = "".join(f"\n{path}\n{fence[0]}\n{text}{fence[1]}\n" for path, text in listings.items())
    return {
        "role": "user",
        "content": "I have *added these files to the chat* so you can go ahead and edit them.\n" + body,
    }


def _conversation(files: dict[str, str] | None, request: str, fence=FENCES[0]) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "Act as an expert software developer."}]
    if files is not None:
        messages += [_files_message(files, fence), {"role": "assistant", "content": "Ok."}]
    return [*messages, {"role": "user", "content": request}]


GEO = OracleTask("geo-1", "area() adds; make it multiply.", (OracleFile("pkg/geo.py", BEFORE, AFTER),))
OTHER = OracleTask("other-1", "fix the other bug", (OracleFile("pkg/other.py", "a = 1\n", "a = 2\n"),))


def test_the_task_is_found_by_its_files_and_answered_in_the_fence_aider_chose():
    fence = ("````", "````")
    messages = _conversation({"pkg/geo.py": BEFORE}, GEO.problem_statement, fence)
    match = identify([OTHER, GEO], messages)
    assert match is not None and match.task is GEO and match.fence == fence and match.at_start == ("pkg/geo.py",)
    text = answer([OTHER, GEO], messages, "whole")
    assert text == f"pkg/geo.py\n````\n{AFTER}````\n"
    # CRLF and trailing spaces in the chat do not hide the file
    crlf = _conversation({"pkg/geo.py": BEFORE.replace("\n", "  \r\n")}, "fix it")
    assert answer([OTHER, GEO], crlf, "diff") == render(GEO.files, "diff")


def test_follow_ups_missing_files_and_strangers():
    tasks = [OTHER, GEO]
    # the fix applied: nothing more to say, Aider ends
    assert answer(tasks, _conversation({"pkg/geo.py": AFTER}, "fix it"), "whole") == DONE
    # no file in the chat: the problem statement names the task, the answer asks for its files (Aider adds them)
    asked = answer(tasks, _conversation(None, f"{GEO.problem_statement}\n\nReply in English."), "diff")
    assert asked == "Please add pkg/geo.py to the chat."
    # unknown files and an unknown request
    assert answer(tasks, _conversation({"pkg/geo.py": "print('hi')\n"}, "do something"), "whole") == DONE
    # the last user message showing files wins
    messages = [
        *_conversation({"pkg/other.py": "a = 1\n"}, OTHER.problem_statement),
        {"role": "assistant", "content": "Please add pkg/geo.py to the chat."},
        _files_message({"pkg/geo.py": BEFORE}),
    ]
    assert answer(tasks, messages, "whole") == render(GEO.files, "whole")
    # a file whose last line has no newline: Aider's fence closes that line
    glued = OracleTask("g", "g", (OracleFile("g.py", "a = 1", "a = 2"),))
    message = {"role": "user", "content": "g.py\n```\na = 1```\n"}
    assert answer([glued], [message], "diff") == edit_block("g.py", "a = 1\n", "a = 2\n")


@pytest.fixture(scope="module")
def responder(tmp_path_factory) -> OracleResponder:
    from aitlrt.common.git import git

    repo = tmp_path_factory.mktemp("geo")
    (repo / "pkg").mkdir()
    (repo / "pkg" / "geo.py").write_text(BEFORE)
    (repo / "pkg" / "old.py").write_text("OLD = 1\n")
    git("init", "-q", cwd=repo)
    git("add", "-A", cwd=repo)
    git("commit", "-qm", "base", cwd=repo)
    (repo / "pkg" / "geo.py").write_text(AFTER)
    fix = git("diff", cwd=repo)
    (repo / "pkg" / "old.py").unlink()
    deletion = git("diff", "--", "pkg/old.py", cwd=repo)
    git("checkout", "--", ".", cwd=repo)
    rows = [
        {"instance_id": "geo-1", "problem_statement": GEO.problem_statement, "repo_path": str(repo), "patch": fix},
        {"instance_id": "gone-1", "problem_statement": "remove old.py", "repo_path": str(repo), "patch": deletion},
    ]
    tasks = [task_from_row(row) for row in rows]
    assert oracle_task(tasks[0]) == GEO
    return OracleResponder(tasks, "whole", str(prepare_bundled_model()))


def test_the_server_answers_like_vllm_with_token_ids(responder):
    assert [t.instance_id for t in responder.tasks] == ["geo-1"]  # a fix that deletes a file cannot be written
    client = TestClient(create_app(responder))
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == "oracle"
    messages = _conversation({"pkg/geo.py": BEFORE}, GEO.problem_statement)
    body = {"model": "oracle", "messages": messages, "logprobs": True, "return_token_ids": True, "temperature": 0}
    reply = client.post("/v1/chat/completions", json=body).json()
    (choice,) = reply["choices"]
    assert choice["message"] == {"role": "assistant", "content": render(GEO.files, "whole")}
    assert choice["finish_reason"] == "stop"
    tok = responder.tokenizer
    template = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert reply["prompt_token_ids"] == tok.encode(template, add_special_tokens=False)
    assert choice["token_ids"][-1] == tok.eos_token_id
    assert tok.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == [0.0] * len(choice["token_ids"])
    usage = reply["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        len(reply["prompt_token_ids"]),
        len(choice["token_ids"]),
    )
    # a plain OpenAI request gets a plain answer
    plain = client.post("/v1/chat/completions", json={"messages": messages}).json()
    assert "prompt_token_ids" not in plain and "logprobs" not in plain["choices"][0]
    streamed = client.post("/v1/chat/completions", json={"messages": messages, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    assert client.post("/v1/chat/completions", json={"messages": "hi"}).status_code == 400


def test_fix_patch_is_the_diff_git_writes_of_the_fix_not_the_tasks_patch_text(tmp_path):
    from aitlrt.common.git import git
    from aitlrt.tasks.patches import reverse, similarity

    # A generated task's patch is its mutation's diff reversed; where the mutation moved lines (here two swapped
    # statements), git's diff of the fix keeps the other line as context: same files, another patch text.
    fixed = "def f(a):\n    a.x = 1\n    a.y = 2\n    return a\n"
    broken = "def f(a):\n    a.y = 2\n    a.x = 1\n    return a\n"
    (tmp_path / "m.py").write_text(fixed)
    git("init", "-q", cwd=tmp_path)
    git("add", "-A", cwd=tmp_path)
    git("commit", "-qm", "fixed", cwd=tmp_path)
    (tmp_path / "m.py").write_text(broken)
    patch = reverse(git("diff", cwd=tmp_path))
    git("commit", "-qam", "broken", cwd=tmp_path)  # the task's start
    (tmp_path / "m.py").write_text(fixed)
    agent = git("diff", cwd=tmp_path)  # what an agent that writes exactly the fixed file leaves
    git("checkout", "--", ".", cwd=tmp_path)

    task = task_from_row(
        {"instance_id": "swap-1", "problem_statement": "swap", "repo_path": str(tmp_path), "patch": patch}
    )
    oracle = oracle_task(task)
    assert oracle.files == (OracleFile("m.py", broken, fixed),)
    assert similarity(agent, patch) < 0.9  # the agent's files are the fix, its patch text is not the task's
    assert similarity(agent, fix_patch(oracle)) == 1.0
    assert aider_applies(render(oracle.files, "diff"), "diff", {"m.py": broken}) == {"m.py": fixed}
    # the responder also takes tasks already read
    assert OracleResponder([oracle], "diff", str(prepare_bundled_model())).tasks == [oracle]


def _feedback_turn(files: dict[str, str], decoy_answer: str, fence=FENCES[0]) -> list[dict[str, str]]:
    """The second request of a decoy-first rollout as Aider sends it: the request and the decoy (done messages), the
    files as they now are, and the tests' output (added to the chat, then sent back as the next request)."""
    output = (
        "I ran this command:\n\npython -I -m aitlrt.tasks.feedback spec.json\n\nAnd got this output:\n\n"
        f"{HEADER} 1 of 3 tests fail; sandbox: bwrap\n________ test_area ________\nassert 5 == 6\n"
    )
    return [
        {"role": "system", "content": "Act as an expert software developer."},
        {"role": "user", "content": GEO.problem_statement},
        {"role": "assistant", "content": decoy_answer},
        _files_message(files, fence),
        {"role": "assistant", "content": "Ok."},
        {"role": "user", "content": output},
        {"role": "assistant", "content": "Ok."},
        {"role": "user", "content": output},
    ]


@pytest.mark.parametrize("edit_format", EDIT_FORMATS)
def test_decoy_first_then_the_fix_written_against_the_decoyed_file(edit_format):
    (first,) = decoy(GEO)
    assert first.path == "pkg/geo.py" and first.before == BEFORE
    # a comment line above the first line the fix changes, indented like it: the code is the same, the bug stays
    assert first.after == BEFORE.replace("    return w + h\n", f"    {DECOY_COMMENT}\n    return w + h\n", 1)
    assert ast.dump(ast.parse(first.after)) == ast.dump(ast.parse(BEFORE))

    tasks = [OTHER, GEO]
    start = _conversation({"pkg/geo.py": BEFORE}, GEO.problem_statement)
    assert not feedback_turn(start)
    assert answer(tasks, start, edit_format) == render(GEO.files, edit_format)  # default: the fix at once
    text = answer(tasks, start, edit_format, decoy_first=True)
    assert text == render([first], edit_format)
    decoyed = aider_applies(text, edit_format, {"pkg/geo.py": BEFORE})
    assert decoyed == {"pkg/geo.py": first.after}

    # the tests' output came back: the file (now holding the decoy) is still the task's, and gets the fix
    fence = ("````", "````")
    second = _feedback_turn(decoyed, text, fence)
    assert feedback_turn(second)
    match = identify(tasks, second)
    assert match is not None and match.task is GEO and match.edited == (("pkg/geo.py", first.after),)
    assert match.at_start == match.done == () and match.distance == 1 and match.fence == fence
    fix = answer(tasks, second, edit_format, decoy_first=True)
    assert fix == answer(tasks, second, edit_format)  # the same without decoy_first
    assert aider_applies(fix, edit_format, decoyed, fence) == {"pkg/geo.py": AFTER}
    if edit_format == "diff":  # the first block takes the decoy's line out as it fixes the line below it
        assert search_replace(first.after, AFTER, "pkg/geo.py")[0] == (
            f"    {DECOY_COMMENT}\n    return w + h\n",
            "    return w * h\n",
        )
    # fixed: nothing more to do, Aider ends
    assert answer(tasks, _feedback_turn({"pkg/geo.py": AFTER}, text), edit_format, decoy_first=True) == DONE


def test_the_decoyed_file_is_told_from_other_tasks_on_the_same_file():
    # another bug in the same file (as the generated tasks of one package have): both decoyed files are near both
    # tasks' starts, each is nearest its own
    other_before = BEFORE.replace("return 2 * (w + h)", "return 2 * w + h")
    twin = OracleTask("geo-2", "perimeter() is wrong", (OracleFile("pkg/geo.py", other_before, BEFORE),))
    tasks = [twin, GEO]
    for task in tasks:
        (first,) = decoy(task)
        match = identify(tasks, _feedback_turn({"pkg/geo.py": first.after}, "..."))
        assert match is not None and match.task is task and match.distance == 1
        fix = answer(tasks, _feedback_turn({"pkg/geo.py": first.after}, "..."), "diff")
        assert aider_applies(fix, "diff", {"pkg/geo.py": first.after}) == {"pkg/geo.py": task.files[0].after}
    # a file far from every task's start is no task's (the problem statement still names one)
    match = identify(tasks, _feedback_turn({"pkg/geo.py": "print('hi')\n" * 30}, "..."))
    assert match is not None and match.task is GEO and not (match.at_start or match.done or match.edited)


def test_the_decoy_goes_where_a_comment_line_changes_nothing():
    # the first changed line is inside a docstring: the decoy goes above the next changed line outside it
    before = 'def f():\n    """Doc.\n    x\n    """\n    return 1\n'
    after = 'def f():\n    """Doc.\n    y\n    """\n    return 2\n'
    (first,) = decoy(OracleTask("s", "s", (OracleFile("s.py", before, after),)))
    assert first.after == before.replace("    return 1\n", f"    {DECOY_COMMENT}\n    return 1\n")
    assert ast.dump(ast.parse(first.after)) == ast.dump(ast.parse(before))
    # after a backslash, or outside Python (no known comment syntax), there is none: decoy_first answers the fix
    for path, before, after in (("b.py", "x = 1 + \\\n    2\n", "x = 1 + \\\n    3\n"), ("m.js", "a = 1\n", "a = 2\n")):
        task = OracleTask("t", "t", (OracleFile(path, before, after),))
        assert decoy(task) == ()
        message = {"role": "user", "content": f"{path}\n```\n{before}```\n"}
        assert answer([task], [message], "diff", decoy_first=True) == render(task.files, "diff")
    # a pure insertion at the end of the file: the decoy goes at the end
    (first,) = decoy(OracleTask("e", "e", (OracleFile("e.py", "a = 1\n", "a = 1\nb = 2\n"),)))
    assert first.after == f"a = 1\n{DECOY_COMMENT}\n"


def test_a_listing_is_read_as_shown():
    text = "pre\n\npkg/a.py\n```\nx = 1\n    ```\n\ny = 2\n```\n\npkg/b.py\n```\nz = 3```\n"
    # a line of the file that ends with the fence, or a last line without a newline that the fence closes: the
    # reading nearer what the file was
    was = "x = 0\n    ```\n\ny = 2\n"
    assert listed(text, "pkg/a.py", was) == (FENCES[0], "x = 1\n    ```\n\ny = 2\n")
    assert listed(text.replace("\n", "\r\n"), "pkg/a.py", was) == (FENCES[0], "x = 1\n    ```\n\ny = 2\n")
    assert listed(text, "pkg/b.py", "z = 2") == (FENCES[0], "z = 3")
    glued = "pkg/a.py\n```\nx = 1```\n\npkg/b.py\n```\nz = 3\n```\n"
    assert listed(glued, "pkg/a.py", "x = 0") == (FENCES[0], "x = 1")
    assert listed(text, "pkg/c.py", "") is None


def test_the_server_answers_decoy_first_when_asked(responder):
    decoying = OracleResponder(responder.tasks, "whole", str(prepare_bundled_model()), decoy_first=True)
    messages = _conversation({"pkg/geo.py": BEFORE}, GEO.problem_statement)
    for server, text in ((responder, render(GEO.files, "whole")), (decoying, render(decoy(GEO), "whole"))):
        reply = TestClient(create_app(server)).post("/v1/chat/completions", json={"messages": messages}).json()
        assert reply["choices"][0]["message"]["content"] == text


def test_the_warm_start_key_changes_with_test_feedback_only():
    from dataclasses import replace

    from aitlrt.rollout.batch import RolloutSettings
    from aitlrt.warmstart.recipe import cache_key

    plain = RolloutSettings(max_calls=None)  # the key pinned when max_calls had no default
    key = cache_key("oracle", [], "/m", plain, ["--epochs", "1"])
    assert key == "1df027195b053621"  # pinned (RECIPE_VERSION 2): a key changes only with what shapes the warm start
    assert cache_key("oracle", [], "/m", replace(plain, test_feedback_max_chars=10), ["--epochs", "1"]) == key
    # test feedback on: the oracle's trajectories include multi-turn ones, another warm start
    on = replace(plain, test_feedback_rounds=1)
    keys = {cache_key("oracle", [], "/m", s, ["--epochs", "1"]) for s in (on, replace(on, test_feedback_max_chars=10))}
    assert len(keys) == 2 and key not in keys
    # the failing tests' output in the statement: other prompts, another warm start; 0 keys as before
    assert cache_key("oracle", [], "/m", replace(plain, statement_test_output=0), ["--epochs", "1"]) == key
    assert cache_key("oracle", [], "/m", replace(plain, statement_test_output=1500), ["--epochs", "1"]) != key

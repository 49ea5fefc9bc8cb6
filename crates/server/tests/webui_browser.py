"""Drives hmoe's web UI in headless Chromium (selenium) against two running servers.

Started by tests/webui.rs, which serves the tiny gpt-oss fixture with a token picker that replays
fixed answers (chosen by the request's seed) one token every few milliseconds:

* --single URL: one model, no API key. Seed 11 answers with reasoning and a Markdown code block,
  seed 12 with a long text (to stop), seed 13 with a short line.
* --router URL --key KEY: router mode over two copies of the fixture (alpha, beta) with
  --models-max 1 and an API key.
* --loading URL --release FILE: one model whose load waits until FILE exists, so that a message
  is sent while the model loads.

Each check prints `ok: ...`; the first failure raises and the script exits non-zero.
"""

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

os.environ.setdefault("SE_AVOID_STATS", "true")

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

WAIT = 40
CHECKS = 0


def ok(what):
    global CHECKS
    CHECKS += 1
    print("ok:", what, flush=True)


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    ok(what)


def http(method, url, body=None, key=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", "Bearer " + key)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def driver_for(args):
    o = Options()
    o.binary_location = args.chromium
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--window-size=1100,820", "--user-data-dir=" + args.profile,
    ):
        o.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=args.chromedriver), options=o)


class Page:
    def __init__(self, d):
        self.d = d

    def el(self, css):
        return self.d.find_element(By.CSS_SELECTOR, css)

    def click(self, css):
        """Clicks css, looking it up again if the page re-rendered it meanwhile."""
        self.wait(lambda: self.el(css).click() is None, "clicking " + css)

    def els(self, css):
        return self.d.find_elements(By.CSS_SELECTOR, css)

    def wait(self, cond, what, timeout=WAIT):
        try:
            return WebDriverWait(self.d, timeout, poll_frequency=0.05,
                                 ignored_exceptions=[StaleElementReferenceException]).until(lambda _: cond())
        except Exception as e:
            logs = self.d.execute_script("return document.body.innerText")
            raise AssertionError(f"timed out waiting for {what}; page text:\n{logs}") from e

    def text(self, el):
        return el.get_attribute("textContent")

    def last(self, css):
        """The textContent of the last element matching css (None if there is none), read in
        one script call: the page re-renders while an answer streams."""
        return self.d.execute_script(
            "const e = [...document.querySelectorAll(arguments[0])].pop();"
            "return e ? e.textContent : null;", css)

    def count(self, css):
        return self.d.execute_script("return document.querySelectorAll(arguments[0]).length;", css)

    def settings(self, **values):
        self.el("#open-settings").click()
        for k, v in values.items():
            box = self.el("#set-" + k)
            box.clear()
            box.send_keys(str(v))
        self.el("#close-settings").click()

    def send(self, text):
        box = self.el("#input")
        box.send_keys(text)
        box.send_keys(Keys.ENTER)

    def streaming(self):
        return self.el("#stop").is_displayed()

    def answer_text(self):
        return self.last(".msg.assistant .body") or ""

    def wait_done(self, what):
        self.wait(lambda: self.count(".msg.assistant") > 0 and not self.streaming(), what)

    def model_status(self, model):
        items = self.els(f'.model-item[data-id="{model}"]')
        return items[0].get_attribute("data-status") if items else None

    def open_models(self):
        if not self.el("#model-panel").is_displayed():
            self.el("#model-button").click()
        self.wait(lambda: len(self.els(".model-item")) > 0, "the model list")


def single_model(page, args):
    d = page.d
    d.get(args.single)
    page.wait(lambda: page.el("#model-name").text == "gptoss-tiny", "the model name")
    ok("single mode shows the model gptoss-tiny")
    check(not page.el("#model-button").is_enabled(), "the model picker is off outside router mode")

    page.settings(seed=11)
    page.send("Say hello")
    page.wait(lambda: page.streaming(), "the stop button while streaming")
    lengths = set()
    while page.streaming():
        lengths.add(len(page.last(".msg.assistant") or ""))
        time.sleep(0.03)
    check(len(lengths) >= 3, f"the answer arrived in pieces (saw {len(lengths)} lengths)")
    time.sleep(0.2)  # a last repaint
    check(page.count(".msg.assistant details.reasoning") == 1
          and page.last(".msg.assistant details.reasoning .thoughts") == "The user greets me. I will answer with code.",
          "reasoning is shown apart, in a collapsible block")
    check(page.count(".msg.assistant details.reasoning .thoughts strong") == 1,
          "Markdown inside the reasoning block")
    check(page.d.execute_script("return document.querySelector('.msg.assistant details.reasoning').open") is False,
          "the reasoning block is collapsed once the answer is there")
    check(page.count(".msg.assistant .body pre code.language-python") == 1
          and page.last(".msg.assistant .body pre code") == 'print("hello")', "a Markdown code block")
    check(page.count(".msg.assistant .body strong") == 1, "Markdown bold text")
    check(page.last(".msg.assistant .body pre code .tok-string") == '"hello"',
          "the code block is highlighted (a string)")
    check("<b>" in page.answer_text() and page.count(".msg.assistant .body b") == 0,
          "HTML in answers is shown as text")
    meta = page.last(".msg.assistant .timings")
    check("generated" in meta and "t/s" in meta, f"speed from timings under the answer ({meta})")
    d.save_screenshot(args.shot)
    ok("screenshot " + args.shot)

    first = page.answer_text()
    page.click(".msg.assistant .regenerate")
    page.wait(lambda: page.streaming(), "regeneration to start")
    page.wait_done("the regenerated answer")
    check(page.count(".msg.assistant") == 1 and page.answer_text() == first,
          "regenerate replaces the last answer")

    page.click(".msg.user .edit")
    check(page.el("#input").get_attribute("value") == "Say hello" and not page.els(".msg"),
          "edit puts the last question back in the box and drops that turn")
    page.el("#input").send_keys(Keys.ENTER)
    page.wait_done("the answer to the edited question")
    check(page.count(".msg.user") == 1 and page.answer_text() == first, "the edited turn is answered")

    # Stop a long answer.
    page.click("#new-chat")
    page.settings(seed=12)
    page.send("Tell me a long story")
    page.wait(lambda: len(page.answer_text()) > 20, "the long answer to start")
    page.click("#stop")
    page.wait(lambda: not page.streaming(), "the stop button to go")
    cut = page.answer_text()
    time.sleep(0.8)
    check(page.answer_text() == cut and len(cut) < 400, f"the answer stopped ({len(cut)} characters)")
    check("stopped" in page.last(".msg.assistant .timings"),
          "the answer says it was stopped")
    idle = False
    for _ in range(100):
        status, body = http("GET", args.single + "slots")
        if status == 200 and not any(s["is_processing"] for s in json.loads(body)):
            idle = True
            break
        time.sleep(0.05)
    check(idle, "the server freed the slot after the stop")

    # Reload: both conversations are still there.
    d.refresh()
    page.wait(lambda: len(page.els(".chat-item")) == 2, "two conversations after the reload")
    titles = [page.text(t) for t in page.els(".chat-item .title")]
    check(titles == ["Tell me a long story", "Say hello"], f"the conversations are kept ({titles})")
    check(page.answer_text() == cut, "the open conversation keeps the stopped answer")
    page.els(".chat-item .title")[1].click()
    page.wait(lambda: 'print("hello")' in page.answer_text(), "the first conversation")
    ok("the first conversation reopens with its answer")

    # A phone-sized window: the list becomes a drawer, nothing overflows sideways.
    d.set_window_size(390, 844)
    page.wait(lambda: page.el("#menu").is_displayed(), "the menu button on a narrow screen")
    wide = d.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
    check(wide <= 0, f"no sideways scrolling on a phone-sized screen ({wide} px)")
    page.click("#menu")
    page.wait(lambda: "drawer" in page.el("#app").get_attribute("class"), "the drawer")
    ok("the conversation list opens as a drawer")
    # The drawer covers the backdrop's middle: click its uncovered right edge.
    page.d.execute_script("document.getElementById('backdrop').click()")
    page.wait(lambda: "drawer" not in page.el("#app").get_attribute("class"), "the drawer to close")
    ok("a tap beside the drawer closes it")
    d.save_screenshot(args.shot.replace(".png", "-phone.png"))
    d.set_window_size(1100, 820)


def router_mode(page, args):
    d = page.d
    base = args.router
    status, _ = http("POST", base + "v1/chat/completions", {"model": "alpha", "messages": []})
    check(status == 401, "the API needs the key")
    status, body = http("GET", base)
    check(status == 200 and "<title>hmoe</title>" in body, "the page loads without the key")
    d.get(base)
    page.wait(lambda: page.el("#key-dialog").is_displayed(), "the API key dialog")
    ok("the page asks for the key")
    page.el("#key-input").send_keys(args.key)
    page.click("#key-ok")
    page.open_models()
    page.wait(lambda: len(page.els(".model-item")) == 2, "two models")
    check([page.model_status(m) for m in ("alpha", "beta")] == ["unloaded", "unloaded"],
          "the picker lists alpha and beta, unloaded")

    page.click('.model-item[data-id="alpha"] .pick')
    check(page.el("#model-name").text == "alpha", "alpha is picked")
    page.settings(seed=13)
    page.send("hi alpha")
    page.wait_done("alpha's answer")
    check(page.answer_text() == "Answer from the router.", "alpha answers")
    page.open_models()
    page.wait(lambda: page.model_status("alpha") == "loaded", "alpha loaded")
    check(page.model_status("beta") == "unloaded", "beta is still unloaded")

    page.click('.model-item[data-id="beta"] .pick')
    page.send("hi beta")
    page.wait_done("beta's answer")
    check(page.answer_text() == "Answer from the router.", "beta answers")
    check(page.count(".msg.assistant") == 2, "both answers are in the conversation")
    page.open_models()
    page.wait(lambda: page.model_status("beta") == "loaded", "beta loaded")
    check(page.model_status("alpha") == "unloaded", "alpha was unloaded (--models-max 1)")

    page.click('.model-item[data-id="beta"] .unload')
    page.wait(lambda: page.model_status("beta") == "unloaded", "beta unloaded by its button")
    ok("the unload button unloads")
    page.click('.model-item[data-id="alpha"] .load')
    page.wait(lambda: page.model_status("alpha") == "loaded", "alpha loaded by its button")
    ok("the load button loads")
    status, body = http("GET", base + "v1/models")
    states = {m["id"]: m["status"]["value"] for m in json.loads(body)["data"]}
    check(states == {"alpha": "loaded", "beta": "unloaded"}, f"the server agrees ({states})")


def loading_mode(page, args):
    page.d.get(args.loading)
    page.settings(seed=13)
    page.send("Are you there?")
    page.wait(lambda: "as soon as the model is ready" in (page.last(".msg.assistant .waiting") or ""),
              "the note that the message waits for the model")
    check(page.count(".msg.assistant .error") == 0, "a message sent during the load is no error")
    with open(args.release, "w"):
        pass
    page.wait(lambda: page.answer_text() == "Answer from the router." and not page.streaming(),
              "the waiting message answered once the model is ready")
    check(page.count(".msg.assistant .waiting") == 0 and page.count(".msg.assistant .error") == 0,
          "the message waited for the load and was answered")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--single", required=True)
    p.add_argument("--router", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--loading", required=True)
    p.add_argument("--release", required=True)
    p.add_argument("--chromium", required=True)
    p.add_argument("--chromedriver", required=True)
    p.add_argument("--profile", required=True)
    p.add_argument("--shot", required=True)
    args = p.parse_args()
    for k in ("single", "router", "loading"):
        setattr(args, k, getattr(args, k).rstrip("/") + "/")
    d = driver_for(args)
    try:
        page = Page(d)
        single_model(page, args)
        router_mode(page, args)
        loading_mode(page, args)
        # 401s are expected (the page learns that it needs the key from one), and so are the
        # loading server's 503s (the page learns that the model is still loading from them).
        loading = args.loading.rstrip("/")
        errors = [e for e in d.get_log("browser")
                  if e.get("level") == "SEVERE" and "401" not in e.get("message", "")
                  and not (e.get("message", "").startswith(loading) and "503" in e.get("message", ""))]
        check(not errors, f"no errors in the browser console ({errors})")
    finally:
        d.quit()
    print(f"webui: {CHECKS} checks passed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print("FAILED:", e, file=sys.stderr)
        sys.exit(1)

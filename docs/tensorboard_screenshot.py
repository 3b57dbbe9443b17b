"""Screenshot of TensorBoard showing a study's runs, for docs/running-a-study.md (docs/tensorboard_demo.png).

    tensorboard --logdir data/demo/runs --port 6006 &
    python docs/tensorboard_screenshot.py "http://localhost:6006/?darkMode=false&runFilter=reorder/.*seed0&tagFilter=loss#timeseries" docs/tensorboard_demo.png

Drives a headless Chromium (Debian package `chromium`) over its DevTools protocol, so the page
renders in real time (Chromium's own --screenshot with a virtual time budget leaves the charts
empty). Needs `pip install websocket-client` (not a dependency of the pipeline).
"""
import base64
import json
import subprocess
import sys
import time
import urllib.request

import websocket

PORT = 9333


def main(url: str, out: str) -> None:
    chrome = subprocess.Popen(["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               "--window-size=1300,820", f"--remote-debugging-port={PORT}", "about:blank"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                tabs = json.load(urllib.request.urlopen(f"http://127.0.0.1:{PORT}/json"))
                break
            except OSError:
                time.sleep(0.2)
        page = next(t for t in tabs if t["type"] == "page")
        ws = websocket.create_connection(page["webSocketDebuggerUrl"], suppress_origin=True)
        calls = iter(range(1, 1000))

        def call(method: str, **params) -> dict:
            n = next(calls)
            ws.send(json.dumps({"id": n, "method": method, "params": params}))
            while True:
                msg = json.loads(ws.recv())
                if msg.get("id") == n:
                    return msg.get("result", {})

        call("Page.enable")
        call("Page.navigate", url=url)
        time.sleep(12)  # the runs load and the charts draw
        # The settings pane opens by default on a wide window: its toggle closes it.
        call("Runtime.evaluate", expression="[...document.querySelectorAll('button')]"
             ".find(b => b.textContent.trim() === 'Settings')?.click()")
        time.sleep(4)
        shot = call("Page.captureScreenshot", format="png")
        with open(out, "wb") as f:
            f.write(base64.b64decode(shot["data"]))
        print(f"wrote {out}")
    finally:
        chrome.kill()


if __name__ == "__main__":
    main(*sys.argv[1:3])

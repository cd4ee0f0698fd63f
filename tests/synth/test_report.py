from cuda_agent.synth.report import render_report, summarize


def test_reasons_keep_their_numbers_and_count_together():
    def rejected(reason):
        return {"accepted": False, "rejected_by": "window", "verdicts": [{"filter": "window", "ok": False, "reason": reason}]}

    candidates = [rejected("eager 0.05 ms outside 0.2..200 ms"), rejected("eager 0.07 ms outside 0.2..200 ms"),
                  rejected("eager 410 ms outside 0.2..200 ms")]
    summary = summarize(candidates, [])
    assert summary["top_reasons"]["window"] == [("eager 0.05 ms outside 0.2..200 ms (and 2 more like it)", 3)]
    text = render_report(summary, {})
    assert "- `window` (3): eager 0.05 ms outside 0.2..200 ms" in text and "N ms" not in text

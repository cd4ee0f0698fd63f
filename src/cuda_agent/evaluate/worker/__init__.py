"""What runs inside the two evaluation processes: the request loop (``python -m cuda_agent.evaluate.worker.loop``),
the candidate's side (untrusted code loaded, its calls timed and described) and the reference's side (inputs made,
outputs compared). Imports the protocol and the base layers, never the evaluator's side."""

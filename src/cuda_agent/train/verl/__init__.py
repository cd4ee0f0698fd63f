"""verl (https://github.com/volcengine/verl) as the RL engine at cluster scale: its trainer, rollout servers
and Ray workers; our tasks, workspace, tools, ReAct loop and evaluator.

    data        ``tasks_to_parquet``: any task source -> the parquet rows verl's ``RLHFDataset`` reads, each
                carrying its task (code, name) and the agent loop that runs it
    agent_loop  ``CudaAgentLoop`` (registered as ``cuda_agent``): one agentic episode per row, our loop
                (``agent.loop.run_episode`` over ``TokenChat``) against verl's rollout server token-in/token-out,
                returned as verl's ``AgentLoopOutput``; imports verl
    reward      ``compute_score``: verl's ``custom_reward_function`` for single-turn rows (stage 1)
    sft         ``TrajectorySFTDataset``: our trajectories, filtered as ``train rft`` filters them, as verl's SFT
                data (``data.custom_cls``), the loss mask 1 exactly on sampled tokens
    launch      ``verl_command``: the command line of each stage (``cuda-agent train ... --engine verl``)
    configs/    override files for verl's trainers with the paper's settings (stages 1, 2a, 3)
    recipe/     a PPO recipe for one GPU node, the evaluation service as the reward (``recipe/README.md``)

The evaluator an episode or a reward uses comes from ``train.evaluators`` (the evaluation service when a URL is
configured or ``CUDA_AGENT_SERVICE`` is set, else local evaluators, one per thread), the task a row carries from
``tasks.rows``: the same code the other stacks' adapters use.

Only ``agent_loop`` imports verl, and nothing outside this package imports ``agent_loop``: the rest of
``cuda_agent`` runs without verl (``pip install 'cuda-agent[verl]'`` adds it).
"""

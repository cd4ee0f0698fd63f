"""The kernel environment in the RL stacks people already train with. One episode core (``core``: tasks as
dataset rows, the single-turn reward, a tool-at-a-time agentic episode over ``agent.session``) under a thin
adapter per stack; each adapter imports its library, nothing else here does:

    trl        TRL's GRPOTrainer: ``kernel_reward`` (the function ``trl grpo --reward_funcs`` loads),
               ``KernelReward`` (single-turn), ``KernelEnvironment`` (multi-turn, ``environment_factory``),
               ``tasks_to_dataset``                                     pip install 'cuda-agent[trl]'
    openenv    OpenEnv environments (``KernelToolEnv``: MCP tools, what the package ``envs/cuda_agent_env``
               serves; ``KernelEnv``; ``KernelReplyEnv``) and their server
               (``python -m cuda_agent.integrations.openenv serve``)    pip install 'cuda-agent[openenv]'
    verl       ``cuda_agent.train.verl`` (agent loop, reward, data, SFT), re-exported as ``integrations.verl``
                                                                         pip install 'cuda-agent[verl]'
    verifiers  verifiers 0.4's taskset plugin, id ``cuda-agent-kernels`` (the package ``cuda_agent_kernels``):
               ``KernelTaskset``, ``KernelTask`` (the reward), ``KernelHarness`` (our episode, model calls
               through verifiers' interception)                         pip install 'cuda-agent[verifiers]'

    export     ``cuda-agent export``: a task source as each stack's dataset, with the reward's settings

docs/INTEGRATIONS.md says which path of each library is used, why, and with which versions.
"""

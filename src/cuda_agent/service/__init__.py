"""The evaluation service: a pool of evaluators (one per GPU, or CPU slots) behind a bounded queue,
on this machine or on a Ray cluster, with an HTTP front and a client that is an evaluator
(``RemoteEvaluator``). A client on top: it uses ``evaluate``; nothing below imports it."""

from cuda_agent.service.backends import local_service, ray_service
from cuda_agent.service.client import RemoteEvaluator
from cuda_agent.service.http import make_server
from cuda_agent.service.messages import Job, Reply, ServiceError
from cuda_agent.service.pool import EvalService, LocalSlot, Slot, SlotLost, execute

__all__ = ["EvalService", "Job", "LocalSlot", "RemoteEvaluator", "Reply", "ServiceError", "Slot", "SlotLost",
           "execute", "local_service", "make_server", "ray_service"]

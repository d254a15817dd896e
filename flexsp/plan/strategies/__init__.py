"""Planning strategies: the registry (``registry``) and one module per built-in strategy.

A new strategy is one module that calls ``register_strategy(Strategy(...))`` at import, plus its
import below (or in the user's own code before planning). Built-ins register in this order, which is
the order ``flexsp simulate`` compares them and the README lists them.
"""
# isort: off  (import order is registration order)
from flexsp.plan.strategies import search, greedy, batchada, static, dynamic_cp  # noqa: F401
# isort: on
from flexsp.plan.strategies.registry import (COMMON_OPTIONS, PlanRequest, Strategy, StrategySpec, describe_strategies,
                                             get_strategy, markdown_list, names, parse_strategy, parse_strategy_list,
                                             register_strategy, run_strategy, strategies, unregister_strategy)

__all__ = ["Strategy", "StrategySpec", "parse_strategy", "parse_strategy_list", "PlanRequest", "register_strategy", "unregister_strategy", "get_strategy", "strategies",
           "names", "run_strategy", "describe_strategies", "markdown_list", "COMMON_OPTIONS"]

from agentrl.cli import console

console()

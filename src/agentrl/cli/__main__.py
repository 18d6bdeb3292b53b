from agentrl.cli import main

main()

from npuprep.cli.main import entry

entry()

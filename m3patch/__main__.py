from m3patch.main import run

run()
